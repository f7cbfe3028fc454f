"""`llmctl bundle create | verify | load`: everything a site needs, across an air gap (docs/offline.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli import ui
from controlplane.errors import ConfigError
from controlplane.settings import load_settings

__all__ = ["register"]

_Signers = Annotated[
    Path,
    typer.Option(
        "--allowed-signers",
        help="ssh-keygen allowed signers file: 'PRINCIPAL ssh-ed25519 KEY' per trusted bundle signer.",
        dir_okay=False,
    ),
]
_Base = Annotated[
    Path | None,
    typer.Option(
        "--base",
        help="The base bundle of an incremental one (default: its name, next to it).",
        dir_okay=False,
    ),
]


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def _named(values: list[str] | None, option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{option} {item!r}: expected MODEL/VARIANT=DIR_OR_URL")
        out[key.strip("/")] = value
    return out


def register(app: typer.Typer) -> None:
    bundle = typer.Typer(help="Offline bundles: create on a connected machine, verify, load on the site.")
    app.add_typer(bundle, name="bundle")

    @bundle.command("create")
    def create(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        inventory: Annotated[Path, typer.Option("--inventory", "-i", help="The site's Ansible inventory.")],
        output: Annotated[
            Path, typer.Option("--output", "-o", help="The bundle file to write.", dir_okay=False)
        ],
        sign_key: Annotated[
            Path, typer.Option("--sign-key", help="Private SSH key that signs the manifest.", dir_okay=False)
        ],
        models: Annotated[
            list[str] | None, typer.Option("--models", help="Models whose weights to carry (NAME[,NAME…]).")
        ] = None,
        weights: Annotated[
            list[str] | None,
            typer.Option(
                "--weights", help="More weights, e.g. LoRA adapters or a draft model: MODEL/VARIANT=DIR."
            ),
        ] = None,
        python: Annotated[
            str, typer.Option("--python", help="The fleet's Python (picks the lock file).")
        ] = "3.11",
        release: Annotated[
            str, typer.Option("--release", help="The fleet's Debian/Ubuntu release.")
        ] = "bookworm",
        lock: Annotated[
            Path | None, typer.Option("--lock", help="Lock file (default: requirements/lock-pyXY.txt).")
        ] = None,
        find_links: Annotated[
            list[Path] | None,
            typer.Option("--find-links", help="Local wheel directory for pip (no index then)."),
        ] = None,
        index_url: Annotated[
            str | None, typer.Option("--index-url", help="PyPI index or mirror for pip.")
        ] = None,
        sarv_wheel: Annotated[
            Path | None,
            typer.Option("--sarv-wheel", help="A built Sarv wheel (default: built from this checkout)."),
        ] = None,
        packages: Annotated[
            list[str] | None,
            typer.Option(
                "--packages", help="Debian packages instead of the roles' set (PKG[,PKG…]); 'none' for none."
            ),
        ] = None,
        gpg_key: Annotated[
            str | None, typer.Option("--gpg-key", help="OpenPGP key in $GNUPGHOME that signs the apt index.")
        ] = None,
        image: Annotated[
            list[str] | None, typer.Option("--image", help="Another image a role runs (repeatable).")
        ] = None,
        no_images: Annotated[
            bool, typer.Option("--no-images", help="Leave container images out (recorded in the manifest).")
        ] = False,
        terraform_mirror: Annotated[
            Path | None,
            typer.Option("--terraform-mirror", help="A `terraform providers mirror` directory to carry."),
        ] = None,
        since: Annotated[
            Path | None,
            typer.Option("--since", help="Pack only what changed since this bundle.", dir_okay=False),
        ] = None,
    ) -> None:
        """Gather the wheels, packages, images, weights, dashboards and providers INVENTORY needs."""
        from controlplane.bundle.create import BundleRequest, create_bundle
        from controlplane.bundle.sources import engine_images, model_weights, role_images, role_packages
        from controlplane.catalog import Catalog
        from controlplane.fleet.loader import load_fleet

        settings = load_settings()
        fleet = load_fleet(inventory)
        names = _split(packages)
        pkgs = [] if names == ["none"] else names or role_packages()
        refs: list[str] = []
        if not no_images:
            refs, notes = role_images(inventory)
            refs += engine_images(fleet, settings.resolved_vllm_image_repository, settings.vllm_image)
            for note in notes:
                ui.warn(note)
        sources, generated = model_weights(_split(models), Catalog.load(settings.catalog))
        req = BundleRequest(
            output=output,
            sign_key=sign_key,
            python=python,
            release=release,
            lock=lock,
            find_links=list(find_links or []),
            index_url=index_url,
            sarv_wheel=sarv_wheel,
            packages=pkgs,
            gpg_key=gpg_key,
            deb_caches=[Path("/var/cache/apt/archives"), settings.home / "debs"],
            images=sorted({*refs, *(image or [])}),
            no_images=no_images,
            models=sources | _named(weights, "--weights"),
            generated=generated,
            terraform_mirror=terraform_mirror,
            since=since,
        )
        with ui.progress() as bar:
            manifest = create_bundle(req, lambda text: bar.update("bundle", text))
        ui.out(f"bundle {output}: {len(manifest.files)} files")
        for part, info in manifest.parts.items():
            if "left_out" in info:
                ui.warn(f"{part}: not included: {info['left_out']}")

    @bundle.command("verify")
    def verify(
        file: Annotated[Path, typer.Argument(help="The bundle file.", dir_okay=False)],
        allowed_signers: _Signers,
        base: _Base = None,
    ) -> None:
        """Check the manifest's signature and every file's sha256; name any file that differs."""
        from controlplane.bundle.manifest import verify_bundle

        with ui.progress() as bar:
            manifest = verify_bundle(
                file, allowed_signers, base=base, progress=lambda t: bar.update("verify", t)
            )
        ui.out(f"{file}: signature good, {len(manifest.files)} files verified")

    @bundle.command("load")
    def load(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        file: Annotated[Path, typer.Argument(help="The bundle file.", dir_okay=False)],
        inventory: Annotated[Path, typer.Option("--inventory", "-i", help="The site's Ansible inventory.")],
        allowed_signers: _Signers,
        work: Annotated[
            Path | None, typer.Option("--work", help="Where to unpack it here (default: FILE.d next to it).")
        ] = None,
        base: _Base = None,
        publish_dir: Annotated[
            Path | None,
            typer.Option("--publish-dir", help="Publish the mirror to this path, not a serving node."),
        ] = None,
        mirror_url: Annotated[
            str | None, typer.Option("--mirror-url", help="The URL the nodes reach the published mirror at.")
        ] = None,
        serve_host: Annotated[
            str | None, typer.Option("--serve-host", help="Inventory host that serves the mirror.")
        ] = None,
        serve_port: Annotated[int, typer.Option("--serve-port", min=1, max=65535)] = 8765,
    ) -> None:
        """Verify FILE, then publish every part where the site consumes it and write the mirror group_vars."""
        from pathlib import PurePosixPath

        from controlplane.bundle.load import LoadRequest, load_bundle
        from controlplane.remote import FabricConnector

        settings = load_settings()
        connector = FabricConnector(key_filename=settings.ssh_key_file, known_hosts=settings.ssh_known_hosts)
        req = LoadRequest(
            bundle=file,
            inventory=inventory,
            allowed_signers=allowed_signers,
            work=work or file.with_name(file.name + ".d"),
            base=base,
            publish_dir=publish_dir,
            mirror_url=mirror_url,
            serve_host=serve_host,
            serve_port=serve_port,
            remote_model_cache=PurePosixPath(settings.remote_model_cache),
        )
        with ui.progress() as bar:
            result = load_bundle(
                req,
                lambda node: connector.connection(node, connect_timeout=10),
                lambda t: bar.update("load", t),
            )
        ui.out(f"mirror: {result.mirror_url}")
        for ref, nodes in result.images.items():
            ui.out(f"image {ref}: {', '.join(nodes)}")
        for store_path, copies in result.weights.items():
            ui.out(f"weights {store_path}: " + ", ".join(f"{c.node} from {c.source}" for c in copies))
        if result.terraform_config is not None:
            ui.out(f"terraform: export TF_CLI_CONFIG_FILE={result.terraform_config}")
        ui.out(f"group_vars: {result.group_vars}")
