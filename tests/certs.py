"""Certificates for TLS tests: a CA, a service certificate it signs, a client certificate."""
from __future__ import annotations

import datetime
from pathlib import Path

SERVICE_NAME = "specdec-services"  # the name the services' certificate carries (service_tls.server_name)


def make_certificates(directory: Path) -> dict[str, str]:
    """Writes ca.pem, service.pem/service.key (for localhost, 127.0.0.1 and SERVICE_NAME) and
    client.pem/client.key, all signed by the CA; returns their paths by those names."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def build(subject: str, key, issuer: str, issuer_key, ca: bool = False, sans=None):
        builder = (
            x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1)).add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem: str, cert, key) -> None:
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (directory / f"{stem}.key").write_bytes(
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            )

    directory.mkdir(parents=True, exist_ok=True)
    ca_key, service_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    write("ca", build("specdec test CA", ca_key, "specdec test CA", ca_key, ca=True), None)
    sans = [x509.DNSName("localhost"), x509.DNSName(SERVICE_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    write("service", build(SERVICE_NAME, service_key, "specdec test CA", ca_key, sans=sans), service_key)
    write("client", build("specdec coordinator", client_key, "specdec test CA", ca_key), client_key)
    return {stem: str(directory / f"{stem}.{ext}") for stem, ext in
            (("ca", "pem"), ("service", "pem"), ("client", "pem"))} | {"service_key": str(directory / "service.key"),
                                                                       "client_key": str(directory / "client.key")}


def service_tls(paths: dict[str, str], mutual: bool = True) -> dict:
    """The coordinator.service_tls section for these certificates."""
    section = {"cert_file": paths["service"], "key_file": paths["service_key"], "ca_file": paths["ca"], "server_name": SERVICE_NAME}
    if mutual:
        section |= {"client_cert_file": paths["client"], "client_key_file": paths["client_key"]}
    return section
