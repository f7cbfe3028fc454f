"""The GPU-generation compatibility table (``gpu_generations.yaml``): what each generation runs, and how.

``load_compat()`` reads the packaged table; ``CompatTable.generation_for(gpu)`` finds a GPU's row by compute
capability or product name; a :class:`Generation` answers which dtypes, weight formats and KV-cache dtypes
its kernels support and which engine image (vLLM version, CUDA version, minimum driver branch) to run.

``python -m controlplane.catalog.compat --ansible ROLE`` prints the driver/CUDA variables the provisioning
roles read (``roles/{nvidia_driver,cuda}/vars/main/gpu_generations.yml``); a test keeps those files equal.
"""

from __future__ import annotations

import itertools
import re
import sys
from functools import cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controlplane.errors import UserError
from controlplane.spec import GPU, Dtype, Quantization

__all__ = ["ROLES", "CompatTable", "Generation", "ImagePin", "ansible_vars", "capability_key", "load_compat"]

_CAPABILITY = re.compile(r"^\d{1,2}\.\d$")


def capability_key(value: str) -> tuple[int, int]:
    """``"8.6"`` → ``(8, 6)``, so capabilities compare as versions ("10.0" > "9.0")."""
    major, minor = value.split(".")
    return int(major), int(minor)


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CapabilityRange(_Row):
    min: str = Field(pattern=_CAPABILITY.pattern)
    max: str = Field(pattern=_CAPABILITY.pattern)

    def contains(self, capability: str) -> bool:
        return capability_key(self.min) <= capability_key(capability) <= capability_key(self.max)


class ImagePin(_Row):
    """The engine image for a generation: a tag of the vLLM server image and what it needs of the host."""

    tag: str = Field(min_length=1)
    cuda: str = Field(pattern=r"^\d+\.\d+$")
    """The CUDA version the image is built on; the cuda role installs the same toolkit."""
    driver_branch: str = Field(pattern=r"^\d{3}$")
    """The oldest NVIDIA driver branch that runs that CUDA version; the nvidia_driver role installs it."""


class Generation(_Row):
    """One row of the table."""

    name: str = Field(pattern=r"^[a-z]+$")
    compute_capability: CapabilityRange
    dtypes: list[Dtype] = Field(min_length=1)
    """Activation dtypes the generation computes in, preferred first."""
    quantizations: list[Quantization] = Field(min_length=1)
    """Weight formats with a kernel on this generation."""
    fp8_compute: Literal["none", "weight-only", "w8a8"]
    kv_cache_dtypes: list[str] = Field(min_length=1)
    image: ImagePin
    models: list[str] = Field(default_factory=list)
    """Regular expressions over product names (as nvidia-smi prints them, without "NVIDIA ")."""

    @model_validator(mode="after")
    def _consistent(self) -> Generation:
        if Quantization.AUTO in self.quantizations or Dtype.AUTO in self.dtypes:
            raise ValueError(f"{self.name}: 'auto' is a choice, not a capability")
        if (Quantization.FP8 in self.quantizations) != (self.fp8_compute != "none"):
            raise ValueError(f"{self.name}: fp8 in quantizations and fp8_compute disagree")
        for pattern in self.models:
            re.compile(pattern)
        return self

    def supports(self, quantization: Quantization) -> bool:
        return quantization in self.quantizations

    def dtype_for(self, requested: Dtype) -> Dtype:
        """``requested`` if the generation computes in it, else its preferred one (bf16 → fp16 on Turing)."""
        if requested in self.dtypes or requested is Dtype.FP32:  # every CUDA GPU computes in fp32
            return requested
        return self.dtypes[0]

    def why_not(self, quantization: Quantization) -> str:
        """The reason a weight format cannot run here (empty when it can)."""
        if self.supports(quantization):
            return ""
        have = ", ".join(q.value for q in self.quantizations)
        return f"{self.name} GPUs have no {quantization.value} kernel (they run: {have})"


class CompatTable(BaseModel):
    """The whole table: generations in capability order, and the vLLM version they share."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1]
    vllm_version: str = Field(pattern=r"^\d+\.\d+\.\d+$")
    generations: list[Generation] = Field(min_length=1)

    @model_validator(mode="after")
    def _ordered_and_disjoint(self) -> CompatTable:
        rows = self.generations
        for a, b in itertools.pairwise(rows):
            if capability_key(a.compute_capability.max) >= capability_key(b.compute_capability.min):
                raise ValueError(f"generations {a.name} and {b.name} overlap or are out of order")
        return self

    def by_name(self, name: str) -> Generation:
        for row in self.generations:
            if row.name == name:
                return row
        raise UserError(
            f"unknown GPU generation {name!r}; known: {', '.join(g.name for g in self.generations)}"
        )

    def by_capability(self, capability: str) -> Generation | None:
        return next((g for g in self.generations if g.compute_capability.contains(capability)), None)

    def by_model(self, model: str) -> Generation | None:
        name = model.removeprefix("NVIDIA ").strip()
        return next((g for g in self.generations if any(re.search(p, name) for p in g.models)), None)

    def generation_for(self, gpu: GPU) -> Generation:
        """The row of ``gpu``: by its compute capability when known (discovery), else by product name.

        Raises :class:`UserError` naming the GPU when no row fits: a GPU older than the table, or a
        product name the table does not know (declare ``sarv_gpu_compute_capability`` for it).
        """
        if gpu.compute_capability:
            row = self.by_capability(gpu.compute_capability)
            if row is None:
                oldest = self.generations[0]
                raise UserError(
                    f"GPU {gpu.model} has compute capability {gpu.compute_capability}, which no supported "
                    f"generation covers (the oldest, {oldest.name}, starts at "
                    f"{oldest.compute_capability.min})",
                    hint="leave the node out of the fleet, or run the model on another GPU type",
                )
            return row
        row = self.by_model(gpu.model)
        if row is None:
            raise UserError(
                f"GPU model {gpu.model!r} is not in the GPU-generation table",
                hint="set sarv_gpu_compute_capability (e.g. 8.6) for its nodes, or discover the fleet "
                "with `llmctl inventory --discover`",
            )
        return row

    def image_for(self, rows: list[Generation], repository: str) -> str:
        """The one image reference for GPUs of ``rows`` (``repository:tag``); a replica runs one image."""
        tags = sorted({r.image.tag for r in rows})
        if len(tags) != 1:
            names = ", ".join(sorted({r.name for r in rows}))
            raise UserError(
                f"a replica spans GPU generations ({names}) that need different engine images "
                f"({', '.join(tags)})",
                hint="keep a replica's GPUs to one generation with a node selector",
            )
        return f"{repository}:{tags[0]}"


@cache
def load_compat() -> CompatTable:
    """The table packaged with Sarv (``controlplane/catalog/gpu_generations.yaml``)."""
    text = resources.files("controlplane.catalog").joinpath("gpu_generations.yaml").read_text()
    try:
        return CompatTable.model_validate(yaml.safe_load(text))
    except ValidationError as exc:  # a packaging defect, not the user's input
        raise RuntimeError(f"gpu_generations.yaml is invalid: {exc}") from exc


# Jinja for the node's row name, over the generated rows (ROWS). A capability outside every row (older
# than the table) also falls back to the newest row; the planner refuses such GPUs with the reason.
_ROW_CHOICE = """\
{%- set ns = namespace(name=ROWS[-1].name, found=false) -%}
{%- set cap = sarv_gpu_compute_capability | default('') | string -%}
{%- set model = sarv_gpu_model | default('') | string | regex_replace('^NVIDIA ', '') -%}
{%- for g in ROWS if not ns.found -%}
{%- if cap -%}
{%- if cap is version(g.compute_capability.min, '>=') and cap is version(g.compute_capability.max, '<=') -%}
{%- set ns.name = g.name -%}{%- set ns.found = true -%}
{%- endif -%}
{%- elif model -%}
{%- for p in g.models if not ns.found and model is search(p) -%}
{%- set ns.name = g.name -%}{%- set ns.found = true -%}
{%- endfor -%}
{%- endif -%}
{%- endfor -%}
{{ ns.name }}"""

ROLES = ("nvidia_driver", "cuda")
"""Roles that take their versions from the table (``roles/<role>/vars/main/gpu_generations.yml``)."""


def ansible_vars(table: CompatTable, role: str) -> str:
    """The YAML of ``roles/<role>/vars/main/gpu_generations.yml``: the rows' driver branch and CUDA version,
    and the node's row, chosen as the planner chooses it: by ``sarv_gpu_compute_capability``, else by
    ``sarv_gpu_model``, else the newest row (whose driver runs every older row's image too)."""
    rows = f"_{role}_gpu_generations"
    lines = [
        "---",
        "# Generated from controlplane/catalog/gpu_generations.yaml by",
        "# `python -m controlplane.catalog.compat --ansible`; do not edit (a test compares the two).",
        f"{rows}:",
    ]
    for g in table.generations:
        cap = g.compute_capability
        models = ", ".join(_yaml_str(m) for m in g.models)
        lines += [
            f"  - name: {g.name}",
            f'    compute_capability: {{min: "{cap.min}", max: "{cap.max}"}}',
            f"    models: [{models}]",
            f'    driver_branch: "{g.image.driver_branch}"',
            f'    cuda_version: "{g.image.cuda}"',
        ]
    lines += [
        f"_{role}_gpu_generation: >-",
        *("  " + ln for ln in _ROW_CHOICE.replace("ROWS", rows).splitlines()),
    ]
    row = f"{rows} | selectattr('name', 'equalto', _{role}_gpu_generation) | first"
    lines += [f'_{role}_gpu_row: "{{{{ {row} }}}}"', ""]
    return "\n".join(lines)


def _yaml_str(text: str) -> str:
    """A double-quoted YAML scalar (the patterns hold backslashes and brackets)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--ansible" or args[1] not in ROLES:
        sys.stderr.write(f"usage: python -m controlplane.catalog.compat --ansible {{{'|'.join(ROLES)}}}\n")
        return 2
    sys.stdout.write(ansible_vars(load_compat(), args[1]))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
