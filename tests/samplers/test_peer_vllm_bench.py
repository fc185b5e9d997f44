"""bench/peer_vllm.py runs end to end at tiny sizes (the recipe's model, one small group,
four concurrent requests, both engines and both OpenAI servers) and ends with one JSON
line; the token counts are checked, no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GROUPS, GROUP_SIZE, CONCURRENCY, NEW_TOKENS = 1, 4, 4, 4


@pytest.mark.slow
def test_peer_vllm_bench_runs_small():
    proc = subprocess.run(
        [sys.executable, "bench/peer_vllm.py", "--sizes", "tiny", "--groups", str(GROUPS), "--group-size",
         str(GROUP_SIZE), "--concurrency", str(CONCURRENCY), "--new-tokens", str(NEW_TOKENS), "--prompt-len", "8",
         "--repeats", "1", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=420, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bench"] == "peer_vllm" and result["goal"] == 1.5
    assert set(result["ratios"]) == {"tiny/groups", f"tiny/concurrency{CONCURRENCY}", f"tiny/server{CONCURRENCY}"}
    assert all(r > 0 for r in result["ratios"].values())
    assert set(result["meets_goal"]) == {"tiny/groups"}
    assert result["machine"]["cpus"] >= 1

    tiny = result["sizes"]["tiny"]
    assert tiny["shape"] == {"family": "llama", "hidden": 192, "layers": 4, "heads": 3, "kv_heads": 3,
                             "head_dim": 64, "intermediate": 512}
    # no early stop in the engines: both generate exactly rows x new tokens
    for case, rows in (("groups", GROUPS * GROUP_SIZE), (f"concurrency{CONCURRENCY}", CONCURRENCY)):
        r = tiny[case]
        assert r["rows"] == rows and r["expected_tokens"] == rows * NEW_TOKENS
        assert r["ours"]["tokens"] == r["vllm"]["tokens"] == rows * NEW_TOKENS, (case, r)
        for side in ("ours", "vllm"):
            assert 0 < r[side]["ttft_ms_p50"] <= r[side]["ttft_ms_p95"]
    assert tiny[f"concurrency{CONCURRENCY}"]["ours"]["backend_calls"] == 1  # the four requests batched

    # the servers stop at <eos>: every request answered, at most max_tokens each, text streamed
    server = tiny[f"server{CONCURRENCY}"]
    for side in ("ours", "vllm"):
        s = server[side]
        assert s["requests"] == CONCURRENCY, (side, s)
        assert 0 < s["tokens"] <= CONCURRENCY * NEW_TOKENS, (side, s)
        assert s["requests_with_text"] >= 1 and s["ttft_ms_p50"] > 0

    assert "ratio = ours tokens/s / vLLM tokens/s" in proc.stdout and "groups" in proc.stdout
