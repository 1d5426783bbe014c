"""``aiocb serve``: one flag per ContinuousBatchingConfig field, and a real server process."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import aiocb
from aiocb.cli.serve import (
    FORCED_EXIT,
    add_serve_arguments,
    chat_parsers,
    config_flags,
    config_from_args,
    flag_problems,
    limits_from_args,
    listen,
    load_model,
    run_serve,
    uvicorn_config,
)
from aiocb.server.limits import ServerLimits

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["some/model", *argv])


def test_every_config_field_has_a_flag() -> None:
    flags = {flag for flag, _ in config_flags()}
    fields = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(aiocb.ContinuousBatchingConfig)}
    assert flags == fields
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    help_text = parser.format_help()
    assert all(flag in help_text for flag in fields)
    # Each with its own description (one docstring entry may name several fields).
    for flag, kwargs in config_flags():
        assert not kwargs["help"].startswith(" (default"), flag
    entry = dict(config_flags())
    assert entry["--kv-padding-interval-size"]["help"] == entry["--q-padding-interval-size"]["help"]
    assert "(default" not in entry["--use-cuda-graph"]["help"].partition("(default")[2][1:]
    # (a served request never waits in add_request: a full queue is a 429)
    served = {action.option_strings[0]: action.help for action in parser._actions if action.option_strings}
    assert "429 with Retry-After" in (served["--max-queue-size"] or "")
    assert "429 with Retry-After" in (served["--max-queued-tokens"] or "")


def test_unset_flags_keep_the_defaults() -> None:
    assert config_from_args(parse()) == aiocb.ContinuousBatchingConfig()


def test_flags_of_every_kind() -> None:
    args = parse(
        "--page-size", "32",
        "--num-blocks", "none",
        "--max-batch-tokens", "512",
        "--max-memory-percent", "0.5",
        "--no-allow-block-sharing",
        "--use-async-batching",
        "--use-cuda-graph", "false,true",
        "--varlen-compile-config", '{"mode": "max-autotune"}',
        "--scheduler-type", "prefill_first",
        "--safety-margin", "0.1",
        "--seed", "7",
        "--cpu-offload-space", "none",
        "--max-queue-size", "64",
    )  # fmt: skip
    config = config_from_args(args)
    expected = aiocb.ContinuousBatchingConfig(
        page_size=32,
        num_blocks=None,
        max_batch_tokens=512,
        max_memory_percent=0.5,
        allow_block_sharing=False,
        use_async_batching=True,
        use_cuda_graph=(False, True),
        varlen_compile_config={"mode": "max-autotune"},
        scheduler_type="prefill_first",
        safety_margin=0.1,
        seed=7,
        cpu_offload_space=None,
        max_queue_size=64,
    )
    assert config == expected
    assert parse("--use-cuda-graph", "true").cb_use_cuda_graph is True
    assert args.host == "127.0.0.1"
    assert args.port == 8000
    assert args.dtype == "auto"


def test_speculative_config_flag() -> None:
    args = parse("--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    assert args.speculative_config == aiocb.SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    assert parse().speculative_config is None
    drafted = parse("--speculative-config", '{"method": "draft", "draft_model": "/models/small"}')
    assert drafted.speculative_config == aiocb.SpeculativeConfig(method="draft", draft_model="/models/small")


def test_chat_parser_flags() -> None:
    assert chat_parsers(parse()) == {"tool_call_parser": "auto", "reasoning_parser": None}
    args = parse("--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1")
    assert chat_parsers(args) == {"tool_call_parser": "mistral", "reasoning_parser": "deepseek_r1"}
    assert chat_parsers(parse("--tool-call-parser", "none"))["tool_call_parser"] is None


def test_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    bad = (
        ("--tool-call-parser", "xml"),
        ("--reasoning-parser", "o1"),
        ("--speculative-config", "{oops"),
        ("--speculative-config", '{"method": "eagle"}'),
        ("--speculative-config", '{"method": "draft"}'),
        ("--speculative-config", "[1]"),
    )
    for flag, value in bad:
        with pytest.raises(SystemExit):
            parse(flag, value)
        capsys.readouterr()
    with pytest.raises(SystemExit):
        parse("--scheduler-type", "lifo")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse("--use-cuda-graph", "maybe")
    capsys.readouterr()
    # (validated before anything loads, named by the flag given)
    for flags, said in (
        (("--page-size", "2"), "aiocb serve: --page-size must be >= 4, got 2"),
        (("--max-request-bytes", "0"), "aiocb serve: --max-request-bytes must be"),
    ):
        assert run_serve(parse(*flags)) == 2
        assert capsys.readouterr().err.startswith(said)
    for template, message in (
        ("missing.jinja", "--chat-template 'missing.jinja': no such file (nor a Jinja template)"),
        ("{% if %}", "--chat-template text: not a Jinja template transformers can compile"),
        ("{{ unclosed", "--chat-template text: not a Jinja template"),
    ):
        assert run_serve(parse("--chat-template", template)) == 2
        assert message in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


#: a chat template of the server's own (``--chat-template``), plain to tell from the tokenizer's
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
)
HELLO = [{"role": "user", "content": "Hello"}]


def test_serve_runs_a_model_directory(model_dir: Path, tmp_path: Path, tokenizer: Any) -> None:
    port = _free_port()
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    command = [sys.executable, "-m", "aiocb.cli.serve", str(model_dir), "--port", str(port)]
    command += ["--served-model-name", "tiny", "--api-key", "k", "--page-size", "16", "--num-blocks", "128"]
    command += ["--chat-template", str(template)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        headers = {"Authorization": "Bearer k"}
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        rendered = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"messages": HELLO}, headers=headers)
        assert rendered.json()["tokens"] == tokenizer("<user> Hello\n<bot>", add_special_tokens=False).input_ids
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "event loop: uvloop" in output


def test_limit_flags() -> None:
    assert limits_from_args(parse()) == ServerLimits()
    args = parse("--max-request-bytes", "1024", "--max-json-depth", "8", "--max-stop-strings", "2")
    assert limits_from_args(args) == ServerLimits(max_request_bytes=1024, max_json_depth=8, max_stop_strings=2)
    args = parse("--max-concurrent-requests", "3", "--body-timeout", "2.5", "--header-timeout", "4")
    assert limits_from_args(args) == ServerLimits(max_concurrent_requests=3, body_timeout=2.5)
    assert args.header_timeout == 4.0
    assert (args.max_connections, args.timeout_keep_alive, args.max_header_bytes) == (4096, 5.0, 16384)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "70000"),
        ("--header-timeout", "0"),
        ("--timeout-keep-alive", "-1"),
        ("--max-connections", "0"),
        ("--max-header-bytes", "0"),
        ("--shutdown-timeout", "-1"),
        ("--shutdown-timeout", "nan"),
        ("--torch-threads", "-1"),
        ("--torch-threads", "100000"),
        ("--api-workers", "-2"),
        ("--device", "bogus"),
        ("--device", "meta"),  # (a torch device, on which no model runs)
        ("--return-logprobs", None),  # (a server's requests always say)
        ("--api-key", " "),  # (taken as no key, the server was open)
        ("--api-key", "sk-secret\r"),  # (a CRLF env file's: no header carries it, every request was a 401)
        ("--api-key", "clé"),
    ],
)
def test_server_flags_out_of_range_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], flag: str, value: str | None
) -> None:
    assert run_serve(parse(flag) if value is None else parse(flag, value)) == 2  # before anything loads
    assert flag in capsys.readouterr().err


def test_serve_under_torchrun_is_refused_before_anything_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank loaded the whole model and served on the same port (the second died of it)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert flag_problems(parse()) == [], "a stale WORLD_SIZE alone is no torchrun"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert run_serve(parse()) == 2
    assert "one of 2 processes torchrun launched (WORLD_SIZE=2)" in capsys.readouterr().err


def test_uvloop_asked_for_but_not_installed_is_refused_before_anything_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a traceback from uvicorn once the model had loaded."""
    real = importlib.util.find_spec  # (uvloop as if not installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert run_serve(parse("--loop", "uvloop")) == 2
    assert "--loop uvloop needs the uvloop package" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    for device in ("cuda", "cuda:1"):
        assert run_serve(parse("--device", device)) == 2
        assert f"--device {device}: this machine has no CUDA device" in capsys.readouterr().err


def test_the_connection_bounds_reach_the_protocol() -> None:
    """--max-connections is the protocol's bound (uvicorn's own answers plain text and
    refuses probes); --send-timeout reaches it too."""
    args = parse("--max-connections", "1", "--send-timeout", "7")
    config = uvicorn_config(None, args, "asyncio")
    assert config.limit_concurrency is None
    assert (config.http.max_connections, config.http.send_timeout) == (1, 7.0)


def test_a_draft_model_that_does_not_load_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in ([], ["--api-workers", "1"]):
        draft = '{"method": "draft", "draft_model": "/nowhere"}'
        args = parse(*flags, "--port", str(_free_port()), "--speculative-config", draft)
        args.model = None  # (the bundled model loads; its draft does not)
        assert run_serve(args) == 2
        error = capsys.readouterr().err
        assert "\naiocb serve: draft_model '/nowhere' could not be loaded" in f"\n{error}", error


def test_a_parser_of_another_format_than_the_template_s_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in ([], ["--api-workers", "1"]):
        args = parse(*flags, "--port", str(_free_port()), "--reasoning-parser", "openai_gptoss")
        args.model = None  # (the bundled model, whose template is no harmony)
        assert run_serve(args) == 2
        error = capsys.readouterr().err
        assert "\naiocb serve: the 'openai_gptoss' parser reads gpt-oss's harmony format" in f"\n{error}", error


def test_a_model_that_does_not_load_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flags in ([], ["--api-workers", "1"]):
        args = parse(*flags, "--port", str(_free_port()))
        args.model = str(tmp_path / "nothing here")
        assert run_serve(args) == 2
        error = capsys.readouterr().err
        assert error.startswith("aiocb serve: cannot load") and "nothing here: no such directory" in error


def test_a_config_that_transformers_refuses_is_a_clean_error(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers' config checks raise their own exceptions (not ValueError): still a
    line naming the problem, not a traceback."""
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    for flags in ([], ["--api-workers", "1"]):
        args = parse(*flags, "--port", str(_free_port()))
        args.model = str(broken)
        assert run_serve(args) == 2
        error = capsys.readouterr().err
        assert (
            error.startswith(f"aiocb serve: cannot load {broken} (or its tokenizer) on cpu:") and "hidden_size" in error
        )
        assert "Traceback" not in error


def test_an_engine_that_does_not_start_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in ([], ["--api-workers", "1"]):
        args = parse(*flags, "--port", str(_free_port()), "--max-batch-tokens", "99999999999")
        args.model = None  # (the bundled model loads; its cache plan fails at start)
        assert run_serve(args) == 2
        error = capsys.readouterr().err
        assert "aiocb serve: the engine did not start: no room for the KV cache" in error, error
        assert "Traceback" not in error


def test_every_address_of_the_host_is_listened_on() -> None:
    """IPv4 and IPv6 hosts alike (a hostname with both: a socket each, on one port)."""
    sockets = listen(parse("--host", "127.0.0.1", "--port", "0"))
    assert not isinstance(sockets, str) and [s.family for s in sockets] == [socket.AF_INET]
    for s in sockets:
        s.close()
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    if socket.has_dualstack_ipv6():  # (IPv6's any address takes IPv4 clients too)
        (any_address,) = listen(parse("--host", "::", "--port", "0"))  # type: ignore[misc]
        assert any_address.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        any_address.close()
    for host in ("::1", "localhost"):
        sockets = listen(parse("--host", host, "--port", "0"))
        assert not isinstance(sockets, str), sockets
        expected = {info[0] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)}
        assert {s.family for s in sockets} == expected and len({s.getsockname()[1] for s in sockets}) == 1
        for s in sockets:
            s.close()


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_port_in_use_fails_before_the_model_loads(workers: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        assert run_serve(parse("--api-workers", workers, "--host", "127.0.0.1", "--port", str(port))) == 2
    assert "cannot listen" in capsys.readouterr().err
    assert time.perf_counter() - started < 0.5, "refused before the model loaded"


def test_without_a_model_the_bundled_one_is_loaded() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert args.model is None
    model, tokenizer = load_model(args)
    assert model.config.model_type == "qwen3"
    assert len(tokenizer) == model.config.vocab_size == 4096


@contextlib.contextmanager
def _serving(log: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """``aiocb serve`` (the bundled model) in a process of its own, ready: the process, its
    URL and port; killed on the way out if it has not exited."""
    port = _free_port()
    command = [sys.executable, "-m", "aiocb.cli.serve", "--port", str(port), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log)
        yield process, url, port
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_drains(tmp_path: Path) -> None:
    """The bundled model by default; SIGTERM lets a running stream finish, then exits 0."""
    with _serving(tmp_path / "server.log", "--shutdown-timeout", "30") as (process, url, port):
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "pycode-tiny"
        body = {"prompt": "def main():", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            process.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
            request_id = stream.headers["x-request-id"]
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events[-2]
        with pytest.raises(httpx.TransportError):  # no longer accepting connections
            httpx.get(f"{url}/health", timeout=2)
        assert process.wait(timeout=60) == 0
    output = (tmp_path / "server.log").read_text()
    assert "draining" in output
    assert f"listening on http://127.0.0.1:{port}" in output
    assert f'"POST /v1/completions" 200 request_id={request_id}' in output
    assert "completion_tokens=200" in output


def test_a_drain_cut_short_exits_with_a_status_that_says_so(tmp_path: Path) -> None:
    """SIGTERM drains; a SIGINT then forces the exit, which a supervisor must tell from a
    drained server's 0."""
    with _serving(tmp_path / "server.log", "--shutdown-timeout", "60") as (process, url, _):
        body = {"prompt": "def main():", "max_tokens": 800, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(httpx.HTTPError):
                for _ in lines:
                    pass
        assert process.wait(timeout=60) == FORCED_EXIT
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "ERROR" not in log, "the app's lifespan ended, not cancelled"
    assert "Application shutdown complete." in log


def _wait_ready(url: str, process: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def _access_log_pids(log: Path) -> set[str]:
    """The processes that logged a completion (not the readiness probes, which either may answer)."""
    return {
        line.split("aiocb.access[")[1].split("]")[0]
        for line in log.read_text().splitlines()
        if "aiocb.access[" in line and '"POST /v1/completions"' in line
    }


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.multiprocess
def test_api_workers_serve_together_and_drain(model_dir: Path, tmp_path: Path, tokenizer: Any) -> None:
    """Two HTTP processes over one engine: the same answers, metrics summed, SIGTERM drains."""
    port = _free_port()
    command = [sys.executable, "-m", "aiocb.cli.serve", str(model_dir), "--port", str(port), "--api-workers", "2"]
    command += ["--served-model-name", "tiny", "--page-size", "16", "--num-blocks", "128", "--shutdown-timeout", "30"]
    command += ["--chat-template", TEMPLATE]  # (the text itself: the workers render with it)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    log = tmp_path / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log)
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        # Fresh connections, which the kernel hands to either worker, until both have served
        # (the readiness probe was answered by one: the other may still be starting).
        answers = []
        deadline = time.monotonic() + 60
        while len(_access_log_pids(log)) < 2 and time.monotonic() < deadline:
            answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
            time.sleep(0.05)
        assert len(_access_log_pids(log)) == 2, "both workers served requests"
        assert {a.status_code for a in answers} == {200}
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1, "greedy: one answer"
        expected = tokenizer("<user> Hello\n<bot>", add_special_tokens=False).input_ids
        for _ in range(4):  # (fresh connections: either worker)
            assert httpx.post(f"{url}/tokenize", json={"messages": HELLO}).json()["tokens"] == expected
        refused = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 10**6}, timeout=60)
        assert refused.status_code == 400 and "context length" in refused.json()["error"]["message"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert _metric(metrics, "aiocb_generation_tokens_total") == len(answers) * 6, "every worker's tokens"
        stream_body = {**body, "max_tokens": 150, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=stream_body, timeout=60) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            process.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events[-2]
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert "with 2 API workers" in output
    assert output.count("draining: no new requests") == 2


def _one_api_worker(model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], Path, int]:
    """``aiocb serve --api-workers 1`` started and ready: the engine process, its log, the port."""
    port = _free_port()
    command = [sys.executable, "-m", "aiocb.cli.serve", str(model_dir), "--port", str(port), "--api-workers", "1"]
    # (its working directory goes in the test's: a killed engine cannot remove it)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    log = tmp_path / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", process, log)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, log, port


def _worker_pid(log: Path) -> int:
    return int(log.read_text().split("API workers (pids ")[1].split(")")[0])


@pytest.mark.multiprocess
def test_a_dead_api_worker_stops_the_server(model_dir: Path, tmp_path: Path) -> None:
    process, log, _ = _one_api_worker(model_dir, tmp_path)
    try:
        worker = _worker_pid(log)
        os.kill(worker, signal.SIGKILL)
        assert process.wait(timeout=60) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert f"API worker {worker} exited" in log.read_text()


@pytest.mark.multiprocess
def test_api_workers_exit_when_the_engine_dies(model_dir: Path, tmp_path: Path) -> None:
    """A killed engine's workers leave too, freeing the port for the supervisor's restart."""
    process, log, port = _one_api_worker(model_dir, tmp_path)
    worker = _worker_pid(log)
    try:
        process.kill()
        process.wait()
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its engine"
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))  # (free again)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
    assert "API worker: the engine closed the connection; exiting" in log.read_text()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
