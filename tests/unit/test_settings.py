"""Connection settings come from the environment, with the dev stack's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.settings import Settings


def test_defaults_reach_the_dev_stack(tmp_path: Path) -> None:
    settings = Settings.from_env({"TRAINGUARD_HOME": str(tmp_path)})  # no stack file there
    assert settings.temporal_address == "127.0.0.1:7233" and settings.namespace == "default"
    assert settings.s3_endpoint is None and settings.s3_path_style
    assert settings.tls_config() is False and settings.api_key is None


def test_mtls_reads_certificate_files(tmp_path: Path) -> None:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_bytes(f"--{name}--".encode())
    settings = Settings.from_env({"TRAINGUARD_TEMPORAL_ADDRESS": "ns.acct.tmprl.cloud:7233",
                                  "TRAINGUARD_TLS_CERT": str(tmp_path / "cert.pem"),
                                  "TRAINGUARD_TLS_KEY": str(tmp_path / "key.pem"),
                                  "TRAINGUARD_TLS_CA": str(tmp_path / "ca.pem")})
    tls = settings.tls_config()
    assert tls.client_cert == b"--cert.pem--" and tls.client_private_key == b"--key.pem--"
    assert tls.server_root_ca_cert == b"--ca.pem--"


def test_api_key_implies_tls_and_a_lone_certificate_is_refused(tmp_path: Path) -> None:
    assert Settings.from_env({"TRAINGUARD_API_KEY": "k"}).tls_config() is not False
    (tmp_path / "cert.pem").write_bytes(b"x")
    with pytest.raises(ValueError, match="TRAINGUARD_TLS_KEY"):
        Settings.from_env({"TRAINGUARD_TLS_CERT": str(tmp_path / "cert.pem")}).tls_config()


def test_s3_endpoint_and_path_style_from_the_environment() -> None:
    settings = Settings.from_env({"AWS_ENDPOINT_URL": "https://minio.internal:9000", "TRAINGUARD_S3_PATH_STYLE": "0",
                                  "AWS_REGION": "eu-west-1"})
    assert settings.s3_endpoint == "https://minio.internal:9000"
    assert not settings.s3_path_style and settings.s3_region == "eu-west-1"


# ------------------------------------------------------------------------------------------ tracing


def test_tracing_is_off_unless_an_otlp_endpoint_or_the_switch_is_set() -> None:
    from trainguard import tracing

    assert tracing.interceptors({}) == []
    assert tracing.enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.enabled({"TRAINGUARD_TRACING": "1"})
    assert not tracing.enabled({"TRAINGUARD_TRACING": "0"})


def test_tracing_keeps_a_tracer_provider_the_process_already_has(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from temporalio.contrib.opentelemetry import TracingInterceptor

    from trainguard import tracing

    own = TracerProvider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: own)

    def refuse(_provider: object) -> None:
        raise AssertionError("replaced the process's own tracer provider")

    monkeypatch.setattr(trace, "set_tracer_provider", refuse)
    monkeypatch.setattr(tracing, "_configured", False)
    [interceptor] = tracing.interceptors({"TRAINGUARD_TRACING": "1"})
    assert isinstance(interceptor, TracingInterceptor)


def test_a_build_id_pins_runs_to_the_controller_build_that_started_them() -> None:
    from temporalio.common import VersioningBehavior

    from workers.controller import deployment_config

    from trainguard.versioning import derived_build_id

    default = deployment_config(Settings.from_env({}))  # versioned by default, the build derived from the code
    assert default is not None and default.version.build_id == derived_build_id()
    assert deployment_config(Settings.from_env({"TRAINGUARD_BUILD_ID": "unversioned"})) is None
    config = deployment_config(Settings.from_env({"TRAINGUARD_BUILD_ID": "2026.12.1"}))
    assert config is not None and config.use_worker_versioning
    assert (config.version.deployment_name, config.version.build_id) == ("trainguard-controller", "2026.12.1")
    assert config.default_versioning_behavior is VersioningBehavior.PINNED


def test_the_stack_a_port_base_or_a_home_names_is_the_one_reached(tmp_path: Path) -> None:
    """One way to address a stack: what moved `trainguard dev up` moves every command, the client and the
    examples with it; an explicit address wins; nothing else falls back to 127.0.0.1:7233 silently."""
    assert Settings.from_env({"TRAINGUARD_PORT_BASE": "20000"}).temporal_address == "127.0.0.1:20000"
    assert Settings.from_env({"TRAINGUARD_PORT_BASE": "20000", "TRAINGUARD_DEV_TLS": "1"}).temporal_address \
        == "127.0.0.1:20004"
    (tmp_path / "stack.json").write_text('{"temporal_address": "127.0.0.1:31000"}')
    from_home = Settings.from_env({"TRAINGUARD_HOME": str(tmp_path)})
    assert from_home.temporal_address == "127.0.0.1:31000" and str(tmp_path) in from_home.address_source
    explicit = Settings.from_env({"TRAINGUARD_HOME": str(tmp_path), "TRAINGUARD_PORT_BASE": "20000",
                                  "TRAINGUARD_TEMPORAL_ADDRESS": "temporal.internal:7233"})
    assert explicit.temporal_address == "temporal.internal:7233"


def test_seaweedfs_admin_grpc_port_follows_its_http_port_convention() -> None:
    from trainguard.ports import Ports

    for base in (None, 20000, 36100):
        ports = Ports.from_base(base)
        assert ports.admin_grpc == ports.admin + 10_000
    with pytest.raises(ValueError, match="TRAINGUARD_PORT_BASE=60000 is too high"):
        Ports.from_base(60000)


# ------------------------------------------------------------------------------------------ boolean flags


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("0", False), ("on", True), ("off", False), ("ON", True), ("OFF", False), ("Off", False),
    ("true", True), ("TRUE", True), ("false", False), ("False", False), ("yes", True), ("YES", True),
    ("no", False), ("No", False), (" off ", False), ("true\n", True),
])
def test_a_flag_reads_every_spelling_in_any_case(value: str, expected: bool) -> None:
    from trainguard.settings import env_flag, parse_flag

    assert parse_flag("TRAINGUARD_CHAOS", value) is expected
    assert env_flag("TRAINGUARD_CHAOS", not expected, {"TRAINGUARD_CHAOS": value}) is expected


@pytest.mark.parametrize("value", ["2", "offf", "of", "disabled", "y", "n", "-1", "o n", "0x0", "nein"])
def test_a_flag_refuses_any_other_word_naming_the_variable(value: str) -> None:
    from trainguard.settings import env_flag

    with pytest.raises(ValueError, match=r"TRAINGUARD_CHAOS=.*on/off"):
        env_flag("TRAINGUARD_CHAOS", True, {"TRAINGUARD_CHAOS": value})


@pytest.mark.parametrize("environ, expected", [({}, True), ({"TRAINGUARD_CHAOS": ""}, True),
                                               ({"TRAINGUARD_CHAOS": "  "}, True), ({"OTHER": "off"}, True)])
def test_an_unset_or_empty_flag_takes_its_default(environ: dict[str, str], expected: bool) -> None:
    from trainguard.settings import env_flag

    assert env_flag("TRAINGUARD_CHAOS", True, environ) is expected
    assert env_flag("TRAINGUARD_CHAOS", False, environ) is not expected


@pytest.mark.parametrize("environ, field, expected", [
    ({"TRAINGUARD_TLS": "TRUE"}, "tls", True), ({"TRAINGUARD_TLS": "on"}, "tls", True),
    ({"TRAINGUARD_TLS": "OFF"}, "tls", False), ({"TRAINGUARD_S3_PATH_STYLE": "OFF"}, "s3_path_style", False),
    ({"TRAINGUARD_S3_PATH_STYLE": "No"}, "s3_path_style", False), ({}, "s3_path_style", True),
])
def test_settings_read_their_flags_through_the_one_parser(tmp_path: Path, environ: dict[str, str], field: str,
                                                          expected: bool) -> None:
    settings = Settings.from_env({"TRAINGUARD_HOME": str(tmp_path), **environ})
    assert getattr(settings, field) is expected


@pytest.mark.parametrize("reader", ["settings", "tracing", "devstack"])
def test_every_reader_refuses_a_misspelt_flag(tmp_path: Path, reader: str) -> None:
    from trainguard import tracing
    from trainguard.devstack import StackConfig

    read = {"settings": lambda: Settings.from_env({"TRAINGUARD_HOME": str(tmp_path), "TRAINGUARD_TLS": "of"}),
            "tracing": lambda: tracing.enabled({"TRAINGUARD_TRACING": "of"}),
            "devstack": lambda: StackConfig.from_env({"TRAINGUARD_DEV_HOSTS": "of"})}[reader]
    with pytest.raises(ValueError, match="=.of.: write one of"):
        read()
