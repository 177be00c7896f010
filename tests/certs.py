"""Certificates for TLS tests, as files: the app's own kind (specdec/serving/certificates.py)."""
from __future__ import annotations

from pathlib import Path

from specdec.serving.certificates import SERVICE_NAME, make_certificates as make_pems


def make_certificates(directory: Path) -> dict[str, str]:
    """Writes ca.pem, service.pem/service.key (for localhost, 127.0.0.1 and SERVICE_NAME) and
    client.pem/client.key, all signed by the CA; returns their paths by those names."""
    directory.mkdir(parents=True, exist_ok=True)
    pems = make_pems(valid_days=1)
    files = {"ca": "ca.pem", "service": "service.pem", "service_key": "service.key", "client": "client.pem", "client_key": "client.key"}
    for part, file_name in files.items():
        (directory / file_name).write_text(getattr(pems, part))
    return {part: str(directory / file_name) for part, file_name in files.items()}


def service_tls(paths: dict[str, str], mutual: bool = True) -> dict:
    """The coordinator.service_tls section for these certificates."""
    section = {"cert_file": paths["service"], "key_file": paths["service_key"], "ca_file": paths["ca"], "server_name": SERVICE_NAME}
    if mutual:
        section |= {"client_cert_file": paths["client"], "client_key_file": paths["client_key"]}
    return section
