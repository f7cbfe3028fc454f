"""The static Terraform module and `llmctl infra`, run for real with the terraform binary (no provider)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from fixtures.common import need, need_binary

from controlplane.errors import ProvisionError

pytestmark = pytest.mark.terraform

REPO = Path(__file__).resolve().parents[2]

EXAMPLE = Path("modules/static/examples/basic")


@pytest.fixture
def infra_copy(tmp_path: Path) -> Path:
    """A private copy of infra/ so state, .terraform and plan files never land in the checkout."""
    need_binary("terraform")
    dest = tmp_path / "infra"
    shutil.copytree(REPO / "infra", dest, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*"))
    return dest


def _llmctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from controlplane.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    captured = capsys.readouterr()
    code = exc.value.code
    return (code if isinstance(code, int) else 1), captured.out, captured.err


def test_terraform_fmt_is_clean() -> None:
    terraform = need_binary("terraform")
    proc = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-diff", str(REPO / "infra")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_static_module_native_tests_pass(infra_copy: Path) -> None:
    """The module's own tests/*.tftest.hcl (plan and apply runs, validation failures) via `terraform test`."""
    module = infra_copy / "modules/static"
    terraform = shutil.which("terraform") or "terraform"
    subprocess.run(
        [terraform, "init", "-input=false"], cwd=module, check=True, capture_output=True, timeout=120
    )
    proc = subprocess.run(
        [terraform, "test", "-no-color"], cwd=module, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"Success! (\d+) passed, 0 failed", proc.stdout), proc.stdout
    assert int(re.search(r"(\d+) passed", proc.stdout).group(1)) >= 5  # type: ignore[union-attr]


def test_llmctl_infra_end_to_end(
    infra_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    workdir = infra_copy / EXAMPLE
    inventory = tmp_path / "out" / "inventory.ini"

    code, out, err = _llmctl(capsys, "infra", "plan", "-C", str(workdir))
    assert code == 0, err
    assert "Plan: 1 to add, 0 to change, 0 to destroy." in out
    assert "module.fleet.terraform_data.this: Plan to create" in err  # progress came from the -json stream
    assert not (workdir / "terraform.tfstate").exists()  # plan changes nothing

    code, out, err = _llmctl(capsys, "infra", "apply", "-C", str(workdir), "--inventory", str(inventory))
    assert code == 0, err
    assert "Applied: 1 to add" in out
    assert "Creation complete" in err
    state = workdir / "terraform.tfstate"
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert not (workdir / ".sarv.tfplan").exists()  # the saved plan is removed after apply
    assert stat.S_IMODE(inventory.stat().st_mode) & 0o007 == 0

    # The written inventory is exactly Terraform's output, and `inventory` prints the same text.
    raw = subprocess.run(
        ["terraform", f"-chdir={workdir}", "output", "-json"], capture_output=True, text=True, check=True
    )
    assert inventory.read_text() == json.loads(raw.stdout)["inventory"]["value"]
    code, out, _ = _llmctl(capsys, "infra", "inventory", "-C", str(workdir))
    assert code == 0
    assert out == inventory.read_text()

    # The round trip the issue asks for: `llmctl inventory -i <generated>` reads the same fleet.
    code, out, err = _llmctl(capsys, "inventory", "-i", str(inventory), "--output", "json")
    assert code == 0, err
    nodes = {n["name"]: n for n in json.loads(out)["nodes"]}
    assert [len(nodes[n]["gpus"]) for n in ("gpu-a1", "gpu-a2", "gpu-c1")] == [8, 8, 2]
    assert nodes["gpu-c1"]["address"] == "10.20.0.31"

    # Applying again changes nothing.
    code, out, err = _llmctl(capsys, "infra", "plan", "-C", str(workdir))
    assert code == 0, err
    assert "Plan: 0 to add, 0 to change, 0 to destroy." in out

    code, _, err = _llmctl(capsys, "infra", "destroy", "-C", str(workdir), "--yes")
    assert code == 0, err
    assert json.loads(state.read_text())["resources"] == []
    code, _, err = _llmctl(capsys, "infra", "inventory", "-C", str(workdir))
    assert code == ProvisionError.exit_code
    assert "has no outputs yet" in err


def test_generated_inventory_has_the_example_layout(infra_copy: Path, tmp_path: Path) -> None:
    """Same groups and sarv_* variables as inventory.example.ini, read by ansible-core and by load_fleet."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader

    from controlplane.terraform import Terraform, write_inventory

    tf = Terraform(infra_copy / EXAMPLE)
    tf.init()
    tf.apply()
    path = write_inventory(tf.inventory(), tmp_path / "inv.ini")

    def layout(p: Path) -> tuple[dict[str, set[str]], set[str]]:
        inv = InventoryManager(loader=DataLoader(), sources=[str(p)])
        children = {name: {c.name for c in g.child_groups} for name, g in inv.groups.items()}
        var_names = {k for g in inv.groups.values() for k in g.get_vars() if k.startswith("sarv_")}
        return children, var_names

    gen_children, gen_vars = layout(path)
    ex_children, ex_vars = layout(REPO / "inventory.example.ini")
    assert gen_children["gpu_nodes"] == {"a100_80g", "rtx"}
    assert (
        gen_children["service_nodes"]
        == ex_children["service_nodes"]
        == {"redis", "monitoring", "controlplane"}
    )
    assert gen_children["all"] == ex_children["all"]
    documented = set(re.findall(r"^#\s+(sarv_\w+)", (REPO / "inventory.example.ini").read_text(), re.M))
    assert gen_vars <= documented, gen_vars - documented
    assert ex_vars <= documented

    inv = InventoryManager(loader=DataLoader(), sources=[str(path)])
    svc = inv.get_host("svc-1")
    assert svc is not None
    assert {g.name for g in svc.get_groups()} >= {"redis", "monitoring", "controlplane"}
    assert svc.vars["ansible_host"] == "10.20.0.101"

    try:
        from controlplane.fleet import load_fleet
    except ImportError:  # pragma: no cover - the fleet package is part of the same tree
        load_fleet = None
    need(load_fleet is not None, "controlplane.fleet.load_fleet is not available")
    assert load_fleet is not None
    fleet = load_fleet(path)
    a1 = fleet.node("gpu-a1")
    assert (len(a1.gpus), a1.gpu_model, a1.interconnect.value, a1.nic) == (
        8,
        "A100-SXM4-80GB",
        "nvlink",
        "ib0",
    )
    assert a1.labels == {"rack": "r1", "tier": "prod"}
    assert a1.gpus[0].memory_total_mib == 81920
    assert fleet.node("gpu-c1").gpu_model == "GeForce RTX 3080"


def test_invalid_variables_fail_with_one_line(
    infra_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = infra_copy / EXAMPLE
    # The example's own values are fixed; a root that forwards a variable lets a var file break it.
    (workdir / "main.tf").write_text(
        (workdir / "main.tf").read_text().replace('gpu_interconnect = "nvlink"', "gpu_interconnect = var.ic")
    )
    (workdir / "ic.tf").write_text('variable "ic" {\n  type        = string\n  description = "test"\n}\n')
    var_file = tmp_path / "bad.tfvars.json"
    var_file.write_text(json.dumps({"ic": "infiniband"}))
    code, _, err = _llmctl(capsys, "infra", "plan", "-C", str(workdir), "--var-file", str(var_file))
    assert code == ProvisionError.exit_code
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: terraform plan failed in {workdir}: Invalid value for variable")
    assert 'gpu_interconnect must be "nvlink" or "pcie"' in errors[0]
    assert "rerun `llmctl infra plan`" in errors[0]


def test_wrapper_refuses_bad_inputs(tmp_path: Path) -> None:
    from controlplane.terraform import Terraform

    with pytest.raises(ProvisionError, match=r"contains no \*\.tf files"):
        Terraform(tmp_path).init()
    (tmp_path / "main.tf").write_text("")
    with pytest.raises(ProvisionError, match="no-such-terraform was not found"):
        Terraform(tmp_path, binary=str(tmp_path / "no-such-terraform")).init()
    with pytest.raises(ProvisionError, match=r"variables file .* does not exist"):
        Terraform(tmp_path).plan([tmp_path / "missing.tfvars"])


def test_missing_provider_is_a_one_line_provision_error(infra_copy: Path, tmp_path: Path) -> None:
    """The OpenStack example against an empty provider mirror: init fails with what to do next."""
    from controlplane.terraform import Terraform

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    cli_config = tmp_path / "terraformrc"
    cli_config.write_text(
        f'provider_installation {{\n  filesystem_mirror {{\n    path = "{mirror}"\n  }}\n}}\n'
    )
    env = {**os.environ, "TF_CLI_CONFIG_FILE": str(cli_config)}
    workdir = infra_copy / "modules/openstack/examples/gpu-cluster"
    with pytest.raises(ProvisionError) as exc:
        Terraform(workdir, env=env).init()
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"terraform init failed in {workdir}: ")
    assert "terraform-provider-openstack/openstack" in message
    assert message.endswith(
        "(check the module sources; offline sites need a provider mirror in the Terraform CLI config)"
    )
    assert exc.value.exit_code == 7
