"""The commands users run first, as subprocesses, on the real default model (SmolLM2-135M)."""

import json
import signal
import subprocess
import sys

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def start(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "disagg.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    while not line.startswith("ready:"):
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(f"exited before ready: {proc.stderr.read()[-2000:]}")
    return proc, line.split()[1]


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    return out, err


def ask(base: str, model: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    return client.chat.completions.create(model=model, max_tokens=20, temperature=0, messages=QUESTION)


def test_disagg_unified_answers_in_english_with_json_logs():
    proc, base = start("unified", "--port", "0", "--log-format", "json")
    try:
        reply = ask(base, "smollm2-135m")
    finally:
        out, err = stop(proc)
    assert "Paris" in reply.choices[0].message.content
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    finished = [x for x in logs if x.get("event") == "request finished"]
    assert [(x["request_id"], x["path"]) for x in finished] == [(reply.id, "/v1/chat/completions")]


def test_disagg_serve_runs_a_whole_cluster_and_stops_cleanly():
    proc, base = start("serve", "--port", "0", "--transfer-backend", "tcp")
    try:
        hint = proc.stdout.readline()  # read here: communicate() skips what readline() buffered
        reply = ask(base, "smollm2-135m")
    finally:
        out, _ = stop(proc)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert hint.startswith(f"try: curl {base}/v1/chat/completions ")
    assert out == "shutting down\n"
