"""The KV bytes each chat turn moved to the decode, against the KV of that turn's new tokens.

    python scripts/kv_per_turn.py --log cluster.log --report bench-out/chat_pd.json --bytes-per-token 46080

`--log` is the output of `disagg serve --log-format json` during a `disagg bench serve --workload chat`
run (the bench names each request `chat-<conversation>-<turn>-<tag>` in X-Request-Id; the decode logs
`kv received` with its `kv_bytes`). A turn's new tokens are its prompt tokens minus the previous
turn's prompt and output tokens (the decode holds those); a turn with no `kv received` line was
prefilled by the decode itself (0 bytes moved). `--bytes-per-token` is the model's KV per token:
layers x 2 x KV heads x head dim x the KV dtype's bytes (SmolLM2-135M in float32: 30 x 2 x 3 x 64 x 4).
"""

from __future__ import annotations

import argparse
import json
import statistics


def kv_bytes_by_turn(log_path: str) -> dict[tuple[int, int], int]:
    moved: dict[tuple[int, int], int] = {}
    with open(log_path, errors="replace") as log:
        for line in log:
            start = line.find("{")
            try:
                event = json.loads(line[start:]) if start >= 0 else {}
            except json.JSONDecodeError:
                continue
            request_id = str(event.get("request_id", ""))
            if event.get("event") == "kv received" and request_id.startswith("chat-"):
                _, conversation, turn, _ = request_id.split("-", 3)
                moved[int(conversation), int(turn)] = int(event["kv_bytes"])
    return moved


def kv_per_turn(log_path: str, report_path: str, bytes_per_token: int) -> dict:
    """Each later turn's KV moved against its new tokens' KV: counts, and the ratios in total (over
    every later turn, those the decode prefilled moving 0 bytes) and over the turns that moved KV."""
    per = json.load(open(report_path))["per_request"]
    moved = kv_bytes_by_turn(log_path)
    turns = {(c, t): (p, o) for c, t, p, o, ok in zip(per["conversation_id"], per["turn_index"], per["num_prompt_tokens"],
                                                      per["num_output_tokens"], per["ok"]) if ok}
    ratios, local, remote_bytes, ideal_bytes, all_ideal = [], 0, 0, 0, 0
    for (c, t), (prompt, _) in sorted(turns.items()):
        if t == 0 or (c, t - 1) not in turns:
            continue
        previous_prompt, previous_output = turns[c, t - 1]
        new_bytes = (prompt - previous_prompt - previous_output) * bytes_per_token
        all_ideal += new_bytes
        if (c, t) not in moved:
            local += 1
            continue
        ratios.append(moved[c, t] / new_bytes)
        remote_bytes += moved[c, t]
        ideal_bytes += new_bytes
    return {"later_turns": len(ratios) + local, "local": local, "moved": len(ratios),
            "total_all": remote_bytes / all_ideal if all_ideal else None,
            "total_moved": remote_bytes / ideal_bytes if ideal_bytes else None,
            "median_moved": statistics.median(ratios) if ratios else None, "max_moved": max(ratios, default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--bytes-per-token", type=int, required=True)
    args = parser.parse_args()
    k = kv_per_turn(args.log, args.report, args.bytes_per_token)
    print(f"later turns: {k['later_turns']} ({k['local']} prefilled by the decode itself, {k['moved']} with KV moved)")
    if k["moved"]:
        print(f"KV moved / KV of the new tokens: over every later turn {k['total_all']:.3f}; over the turns with KV "
              f"moved: total {k['total_moved']:.3f}, median {k['median_moved']:.3f}, max {k['max_moved']:.3f}")


if __name__ == "__main__":
    main()
