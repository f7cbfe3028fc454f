"""TLS at the gateway: the server context from certificate and key files, reloaded in place on SIGHUP.

The listening socket keeps its one :class:`ssl.SSLContext`; a reload loads the new chain into that same
context, so connections opened after it see the new certificate and open ones keep theirs. The new files
are first loaded into a scratch context: a bad certificate or key is logged and the old one kept.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.errors import ConfigError

__all__ = ["TlsContextFactory", "TlsFiles", "server_context", "tls_files"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of the gateway's TLS listener."""

    cert: Path
    """Certificate chain, the server's certificate first."""
    key: Path
    """Its private key (unencrypted; keep it 0600, readable by the gateway's user only)."""
    client_ca: Path | None = None
    """When set, every caller must present a certificate this CA signed (service-to-service mTLS)."""


def tls_files(cert: Path | None, key: Path | None, client_ca: Path | None) -> TlsFiles | None:
    """The TLS files from settings or options (None: plain HTTP), checked by loading them once."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ConfigError(
                "gateway_tls_client_ca needs TLS: set gateway_tls_cert and gateway_tls_key as well"
            )
        return None
    if cert is None or key is None:
        missing = "gateway_tls_key (--tls-key)" if cert else "gateway_tls_cert (--tls-cert)"
        raise ConfigError(f"TLS needs both a certificate and a key; {missing} is not set")
    files = TlsFiles(cert=cert, key=key, client_ca=client_ca)
    server_context(files)
    return files


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A TLS 1.2+ server context holding ``files``; a :class:`ConfigError` naming the file that is wrong."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, files)
    if files.client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    for what, path in (("certificate", files.cert), ("key", files.key), ("client CA", files.client_ca)):
        if path is not None and not path.is_file():
            raise ConfigError(f"TLS {what} file {path} does not exist or is not a file")
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"cannot load the TLS certificate {files.cert} with the key {files.key}: {_why(exc)}",
            hint="both must be PEM, the key unencrypted and matching the certificate",
        ) from None
    if files.client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=files.client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"cannot load the client CA file {files.client_ca}: {_why(exc)}") from None


def _why(exc: ssl.SSLError | OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc).lower().replace("_", " ")
    return exc.strerror or str(exc)


class TlsContextFactory:
    """uvicorn's ``ssl_context_factory``: builds the context in each worker and reloads it on SIGHUP.

    Picklable (uvicorn hands it to worker processes). With ``--workers`` > 1 the gateway's supervisor
    (``server._TlsReloadSupervisor``) passes SIGHUP on to every worker, which reloads here in place.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files

    def __call__(self, config: Any, default: Any) -> ssl.SSLContext:
        ctx = server_context(self.files)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop: no reload
            return ctx
        loop.add_signal_handler(signal.SIGHUP, self.reload, ctx)
        return ctx

    def reload(self, ctx: ssl.SSLContext) -> bool:
        """Load the files again into ``ctx``; False (old certificate kept, error logged) when they fail."""
        try:
            server_context(self.files)  # all or nothing: a broken pair must not half-replace the old one
            _load(ctx, self.files)
        except ConfigError as exc:
            logger.error("TLS reload failed, keeping the current certificate: %s", exc.message)
            return False
        logger.info("TLS certificate reloaded from %s", self.files.cert)
        return True
