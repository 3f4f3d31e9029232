"""The TLS rules without a network: when a join token may cross plain TCP, and the start-up refusals
(half a certificate pair, unreadable or mismatched files, plain TCP off loopback) with their fixes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from inferd.config import ConfigError, ServerConfig, load_server_config
from inferd.tls import check_server_tls, client_context, plain_join_allowed, worker_ca_pem
from inferd.worker.main import main as worker_main
from inferd.worker.main import transport


@pytest.mark.parametrize(
    ("host", "tls", "insecure", "allowed"),
    [
        ("127.0.0.1", False, False, True),
        ("127.3.4.5", False, False, True),
        ("localhost", False, False, True),
        ("::1", False, False, True),
        ("[::1]", False, False, True),
        ("0.0.0.0", False, False, False),
        ("10.0.0.7", False, False, False),
        ("router.example", False, False, False),
        ("10.0.0.7", True, False, True),
        ("10.0.0.7", False, True, True),
        ("0.0.0.0", False, True, True),
    ],
)
def test_plain_tcp_token_exchange_only_on_loopback_or_insecure(
    host: str, tls: bool, insecure: bool, allowed: bool
) -> None:
    assert plain_join_allowed(host, tls=tls, insecure=insecure) is allowed


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pair")
    issued = trustme.CA().issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(d / "cert.pem")
    issued.private_key_pem.write_to_path(d / "key.pem")
    return d / "cert.pem", d / "key.pem"


def config(**overrides: object) -> ServerConfig:
    return load_server_config(None, dict(overrides), environ={"INFERD_JOIN_TOKEN": "t"})


@pytest.mark.parametrize(
    ("given", "missing"), [("ssl_certfile", "--ssl-keyfile"), ("worker_ssl_keyfile", "--worker-ssl-certfile")]
)
def test_half_a_pair_is_refused_naming_the_other_flag(
    given: str, missing: str, pair: tuple[Path, Path]
) -> None:
    with pytest.raises(ConfigError, match=f"pass {missing} too"):
        config(**{given: pair[0]})


def test_missing_unreadable_or_mismatched_files_are_refused_at_start(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = pair
    with pytest.raises(ConfigError, match=r"--ssl-certfile \(certificate\) .*nope.pem: cannot read it"):
        check_server_tls(config(ssl_certfile=tmp_path / "nope.pem", ssl_keyfile=key))
    other = trustme.CA().issue_cert("127.0.0.1")
    other.private_key_pem.write_to_path(tmp_path / "other-key.pem")
    with pytest.raises(ConfigError, match="not a PEM certificate and its private key"):
        check_server_tls(config(ssl_certfile=cert, ssl_keyfile=tmp_path / "other-key.pem"))
    with pytest.raises(ConfigError, match="--worker-ssl-keyfile"):
        check_server_tls(
            config(worker_port=0, worker_ssl_certfile=cert, worker_ssl_keyfile=tmp_path / "nope.pem")
        )
    check_server_tls(config(ssl_certfile=cert, ssl_keyfile=key, worker_port=0, worker_host="0.0.0.0"))


def test_a_worker_port_off_loopback_needs_tls_or_insecure(pair: tuple[Path, Path]) -> None:
    with pytest.raises(ConfigError, match=r"plain TCP.*--ssl-certfile.*--insecure"):
        check_server_tls(config(worker_port=9000, worker_host="0.0.0.0"))
    with pytest.raises(ConfigError, match="plain TCP"):  # Ray actors join over the worker port too
        check_server_tls(config(ray_address="local", worker_host="10.0.0.7"))
    check_server_tls(config(worker_port=9000, worker_host="0.0.0.0", insecure=True))
    check_server_tls(config(worker_port=9000))  # loopback: as before, no flag needed


def test_ray_actors_trust_the_worker_ports_own_certificate(pair: tuple[Path, Path]) -> None:
    cert, key = pair
    assert worker_ca_pem(config(ray_address="local")) == ""
    pem = worker_ca_pem(config(ray_address="local", ssl_certfile=cert, ssl_keyfile=key))
    assert pem == cert.read_text()
    client_context(ca_pem=pem)  # a context that trusts it as it is


def test_worker_refuses_plain_tcp_off_loopback_unless_insecure(capsys: pytest.CaptureFixture[str]) -> None:
    code = worker_main(["--connect", "10.0.0.7:9000", "--model", "sim", "--token", "t"])
    assert code == 2
    assert "plain TCP" in capsys.readouterr().err
    assert transport("10.0.0.7:9000", None, "", insecure=True) is None
    assert transport("127.0.0.1:9000", None, "", insecure=False) is None
    assert transport("unix:/tmp/x.sock", None, "", insecure=False) is None


def test_worker_with_a_ca_file_joins_over_tls_and_an_unreadable_one_is_refused(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    ctx = transport("10.0.0.7:9000", pair[0], "", insecure=False)
    assert ctx is not None and ctx.check_hostname
    with pytest.raises(ConfigError, match=r"--ca-file .*nope.pem: cannot read it"):
        transport("10.0.0.7:9000", tmp_path / "nope.pem", "", insecure=False)
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="no usable PEM certificate"):
        transport("10.0.0.7:9000", tmp_path / "junk.pem", "", insecure=False)


def test_ray_actor_arguments_carry_the_ca_or_insecure() -> None:
    pytest.importorskip("ray")
    from inferd.fleet.ray_launcher import actor_transport_args

    assert actor_transport_args("PEM", insecure=False) == ["--ca-pem", "PEM"]
    assert actor_transport_args("", insecure=True) == ["--insecure"]
    assert actor_transport_args("", insecure=False) == []
