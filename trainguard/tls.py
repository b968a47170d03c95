"""TLS for the embedded stack: a private CA, certificates, and a mutual-TLS front for the Temporal dev server.

`temporal server start-dev` speaks plain gRPC only. `trainguard dev up --tls` (or `TRAINGUARD_DEV_TLS=1`)
keeps it on loopback and puts this front before it: every worker, the CLI and the client then reach Temporal
over TLS 1.2+ with client certificates, through the same settings they would use against a Temporal cluster
or Temporal Cloud (`TRAINGUARD_TLS_CERT`, `TRAINGUARD_TLS_KEY`, `TRAINGUARD_TLS_CA`). A connection without a
client certificate signed by the stack's CA is refused during the handshake.

    python -m trainguard.tls --listen 127.0.0.1:7443 --target 127.0.0.1:7233 --dir .trainguard/tls
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import signal
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class DevCerts:
    """PEM files of the stack's CA, the TLS front's server certificate and one client certificate."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server-key.pem"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "client-key.pem"

    def client_env(self) -> dict[str, str]:
        """What a worker, the CLI or the client needs in its environment to connect."""
        return {"TRAINGUARD_TLS_CERT": str(self.client_cert), "TRAINGUARD_TLS_KEY": str(self.client_key),
                "TRAINGUARD_TLS_CA": str(self.ca)}


def make_dev_certs(directory: Path, days: int = 365) -> DevCerts:
    """A CA and its server (127.0.0.1, localhost) and client certificates, made once; kept if present."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    certs = DevCerts(directory)
    if all(p.exists() for p in (certs.ca, certs.server_cert, certs.server_key, certs.client_cert, certs.client_key)):
        return certs
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "trainguard dev stack"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("trainguard dev CA")).issuer_name(name("trainguard dev CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(common: str, usage: x509.ObjectIdentifier, key_path: Path, cert_path: Path,
             san: list[x509.GeneralName] | None = None) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(common)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        write_key(key, key_path)
        cert_path.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))

    leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH, certs.server_key, certs.server_cert,
         [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    leaf("trainguard dev client", ExtendedKeyUsageOID.CLIENT_AUTH, certs.client_key, certs.client_cert)
    certs.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))  # last: its presence means all are there
    return certs


def server_context(certs: DevCerts) -> ssl.SSLContext:
    """TLS 1.2+, HTTP/2 (gRPC) by ALPN, client certificates required and checked against the CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certs.server_cert, certs.server_key)
    context.load_verify_locations(certs.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


async def serve(listen: tuple[str, int], target: tuple[str, int], context: ssl.SSLContext,
                stop: asyncio.Event) -> None:
    """Terminate TLS on `listen` and pass the bytes to `target` until `stop` is set."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    server = await asyncio.start_server(accept, *listen, ssl=context)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="mutual-TLS front for the Temporal dev server")
    parser.add_argument("--listen", required=True, help="host:port to accept TLS on")
    parser.add_argument("--target", required=True, help="host:port of the plain-text server")
    parser.add_argument("--dir", required=True, type=Path, help="where the CA and certificates are (made if absent)")
    args = parser.parse_args(argv)

    def address(text: str) -> tuple[str, int]:
        host, _, port = text.rpartition(":")
        return host, int(port)

    certs = make_dev_certs(args.dir)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(address(args.listen), address(args.target), server_context(certs), stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
