"""`hspec serve`'s start-up: bad settings give one-line errors before anything loads, the port it
announces is the one bound, a KV pool too small to serve is refused or warned of, a missing `[serve]`
extra says what to install.

Fast tests hand `open_server` the tiny target (conftest's `chat_target`); one slow test starts the real
command on the embedded target.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from hspec.cli import main
from hspec.drafters import create_drafter
from hspec.serving.app import build_engine
from hspec.serving.limits import LOOPBACK_NAMES, ServingLimits
from hspec.serving.server import ServerThread, ServeSettings, access_limits, bind_socket, check_pool, open_server


def _cli_error(capsys, *args: str) -> str:
    """Run `hspec serve ARGS`, expect exit status 2; return stderr, which must be one line, no traceback."""
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("args, expected", [
    (("--kv-budget-mib", "0"), "--kv-budget-mib must be > 0"),
    (("--kv-budget-mib", "-3"), "--kv-budget-mib must be > 0"),
    (("--kv-pages", "0"), "--kv-pages must be >= 1"),
    (("--port", "99999"), "--port must be in 0..65535"),
    (("--port", "-1"), "--port must be in 0..65535"),
    (("--max-request-bytes", "0"), "--max-request-bytes must be >= 1"),
    (("--threads", "-2"), "--threads must be >= 0"),
    (("--spec-max-batch", "-1"), "--spec-max-batch must be >= 0 (0: never speculate), got -1"),
    (("--drafter", "ngram", "--drafter-option", "node_budget=5"), "'node_budget=5': no drafter here takes it"),
    (("--max-waiting", "-1"), "--max-waiting must be >= 0"),
    (("--request-timeout", "0"), "--request-timeout must be > 0 seconds, got 0.0"),
    (("--max-failed-steps", "0"), "--max-failed-steps must be >= 1"),
    (("--max-connections", "0"), "--max-connections must be >= 1"),
    (("--header-timeout", "0"), "--header-timeout must be > 0 seconds"),
    (("--keep-alive-timeout", "0"), "--keep-alive-timeout must be >= 1 second"),
    (("--drain-timeout", "-1"), "--drain-timeout must be >= 0 seconds"),
    (("--api-key", " "), "--api-key must not be empty"),
])
def test_bad_settings_get_one_line_errors_before_loading(capsys, args, expected):
    assert expected in _cli_error(capsys, *args)


@pytest.mark.parametrize("argv, new", [(("serve", "--kv-blocks", "64"), "--kv-pages"),
                                       (("serve", "--block-size", "8"), "--page-size"),
                                       (("bench", "serve", "--block-size", "8"), "--page-size")])
def test_the_kv_pool_flags_spelled_before_pages_name_their_new_spelling(capsys, argv, new):
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2 and f"{argv[-2]} is now {new}" in capsys.readouterr().err


def test_the_api_key_comes_from_hspec_api_key_when_not_given(capsys, monkeypatch):
    monkeypatch.setenv("HSPEC_API_KEY", "  ")  # read, and refused as blank, before anything loads
    assert "--api-key must not be empty" in _cli_error(capsys)


def test_loopback_answers_loopback_hosts_only_and_other_addresses_without_a_key_warn():
    limits, warning = access_limits("127.0.0.1", ServingLimits())
    assert limits.allowed_hosts == LOOPBACK_NAMES and warning is None
    assert access_limits("::1", ServingLimits())[0].allowed_hosts == LOOPBACK_NAMES
    limits, warning = access_limits("0.0.0.0", ServingLimits())
    assert limits.allowed_hosts is None and "0.0.0.0" in warning and "--api-key" in warning
    assert access_limits("0.0.0.0", ServingLimits(api_key="k"))[1] is None


def test_a_port_in_use_is_a_one_line_error(capsys):
    with bind_socket("127.0.0.1", 0) as taken:
        taken.listen()
        port = taken.getsockname()[1]
        err = _cli_error(capsys, "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_without_the_serve_extra_it_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # find_spec -> None: as if not installed
    err = _cli_error(capsys)
    assert "uvicorn" in err and "pip install 'hspec[serve]'" in err


def _engine(target, num_pages: int, page_size: int, K: int = 4):
    drafter = create_drafter("ngram", target.config, target_model=target.model)
    return build_engine(target.model, drafter, target.tokenizer, K, num_pages=num_pages, page_size=page_size)


def test_a_pool_that_cannot_hold_one_request_is_refused_naming_the_minimum(chat_target):
    # a 1-token prompt with max_tokens=1 at K=4 holds 1 + 1 + 4 + 1 = 7 positions: 2 pages of 4
    with pytest.raises(ValueError, match=r"too few for any request.*--kv-pages >= 2"):
        check_pool(_engine(chat_target, num_pages=1, page_size=4), default_max_tokens=256)


def test_a_pool_too_small_for_the_default_output_is_warned_of(chat_target):
    warning = check_pool(_engine(chat_target, num_pages=1, page_size=16), default_max_tokens=256)
    # 1 + 256 + 4 + 1 = 262 positions: 17 pages of 16
    assert warning is not None and "16 tokens" in warning and "--kv-pages >= 17" in warning
    assert check_pool(_engine(chat_target, num_pages=17, page_size=16), default_max_tokens=256) is None


def test_port_0_announces_the_port_bound_and_the_settings_reach_the_app(chat_target):
    app, sock, announcement = open_server(ServeSettings(target="tiny", drafter="none", kv_pages=64, port=0,
                                                        max_request_bytes=200), chat_target)
    with ServerThread(app, sock=sock) as srv:
        assert srv.port != 0 and announcement.endswith(f"on http://127.0.0.1:{srv.port}")
        assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
        big = httpx.post(f"{srv.url}/v1/completions", json={"model": "llama", "prompt": "x" * 300})
        assert big.status_code == 413


def test_spec_max_batch_reaches_the_engine_and_the_announcement(chat_target):
    settings = ServeSettings(target="tiny", drafter="ngram", kv_pages=64, port=0, speculate_max_batch=3)
    app, sock, announcement = open_server(settings, chat_target)
    sock.close()
    assert app.state.engine.speculate_max_batch == 3
    assert "(K=7, speculating while at most 3 sequences run)" in announcement


def test_drafter_options_reach_the_served_drafter(chat_target):
    settings = ServeSettings(target="tiny", drafter="specblock", kv_pages=64, port=0, random_drafter_weights=True,
                             drafter_options=("node_budget=5", "adapt_tree=false"))
    app, sock, _ = open_server(settings, chat_target)
    sock.close()
    config = app.state.engine.stages.drafter.config
    assert config.node_budget == 5 and not config.adapt_tree


def test_a_pool_too_small_is_refused_at_start_and_the_port_freed(chat_target):
    with bind_socket("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    # a 1-token prompt with max_tokens=1 at K=7 holds 10 positions: 3 pages of 4
    settings = ServeSettings(target="tiny", drafter="ngram", K=7, kv_pages=1, page_size=4, port=port)
    with pytest.raises(ValueError, match="--kv-pages >= 3"):
        open_server(settings, chat_target)
    with bind_socket("127.0.0.1", port) as again:
        again.listen()  # nothing holds the port any more


def test_a_small_pool_starts_with_a_warning_naming_the_pages_needed(chat_target, capsys):
    # plain decoding (K=0): the default 256 tokens after a 1-token prompt hold 258 positions, 17 pages of 16
    _, sock, _ = open_server(ServeSettings(target="tiny", drafter="none", kv_pages=2, port=0), chat_target)
    sock.close()
    err = capsys.readouterr().err
    assert "warning" in err and "32 tokens (2 pages of 16)" in err and "--kv-pages >= 17" in err


@pytest.mark.slow
def test_hspec_serve_port_0_on_the_real_target(tmp_path):
    """The real command: it announces the port it bound, and answers there."""
    process = subprocess.Popen([sys.executable, "-m", "hspec.cli", "serve", "--port", "0", "--drafter", "none",
                                "--kv-pages", "64", "--threads", "1", "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        line = ""
        while "on http://" not in line:
            assert time.monotonic() < deadline and process.poll() is None, f"no announcement; last line {line!r}"
            line = process.stdout.readline()
        port = int(re.search(r"on http://127\.0\.0\.1:(\d+)", line).group(1))
        assert port != 0
        for _ in range(100):  # the announcement comes just before uvicorn starts listening
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        else:
            raise AssertionError(f"nothing answers on the announced port {port}")
    finally:
        process.terminate()
        process.wait(30)


def test_bind_socket_names_the_address_it_could_not_bind():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            bind_socket("127.0.0.1", taken.getsockname()[1])
