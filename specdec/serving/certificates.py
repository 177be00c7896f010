"""Certificates for the links between the coordinator and the services: a CA of the app's own
that signs the services' certificate and the coordinator's client certificate. An app started
on a Ray cluster without certificates of its user's (coordinator.service_tls) gets a fresh set,
passed inline like its service token, so the links inside are mutual TLS by default there."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

SERVICE_NAME = "specdec-services"  # the name the services' certificate carries (service_tls.server_name)


@dataclass
class Certificates:
    """PEM text of each part."""

    ca: str
    service: str
    service_key: str
    client: str
    client_key: str

    def service_tls(self, mutual: bool = True) -> dict:
        """The coordinator.service_tls section with the PEM text inline."""
        section = {"cert_file": self.service, "key_file": self.service_key, "ca_file": self.ca, "server_name": SERVICE_NAME}
        if mutual:
            section |= {"client_cert_file": self.client, "client_key_file": self.client_key}
        return section


def make_certificates(valid_days: int = 365) -> Certificates:
    """A CA, the services' certificate (for SERVICE_NAME, localhost and 127.0.0.1) and the
    coordinator's client certificate, both signed by it; P-256 keys."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_name = "specdec app CA"

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def signed(subject: str, key, issuer_key, ca: bool = False, sans=None) -> str:
        builder = (
            x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(ca_name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()

    def private(key) -> str:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()

    ca_key, service_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    sans = [x509.DNSName(SERVICE_NAME), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    return Certificates(
        ca=signed(ca_name, ca_key, ca_key, ca=True),
        service=signed(SERVICE_NAME, service_key, ca_key, sans=sans), service_key=private(service_key),
        client=signed("specdec coordinator", client_key, ca_key), client_key=private(client_key),
    )
