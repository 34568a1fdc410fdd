"""Draw the server workload's output tok/s and TPOT against concurrency; print results as a table.

    python bench/plot.py docs/bench/h200_server.json [more server JSON] --out docs/bench/h200_server.png
    python bench/plot.py --markdown docs/bench/h200_*.json     (a Markdown table for docs/BENCHMARKS.md)

Reads the JSON that `build.py bench --json` writes. matplotlib is imported only to draw (pip install
matplotlib): it is no dependency of kiln's, and --markdown runs without it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(files: list[str]) -> list[dict]:
    return [json.loads(Path(f).read_text()) for f in files]


def series(rec: dict, side: str) -> tuple[list[int], list[float], list[float]]:
    """-> (concurrency, output tok/s, median TPOT ms) of the server or the offline side of a server run."""
    rows = [(lv["concurrency"], lv[side]) for lv in rec["levels"] if lv.get(side)]
    rows.sort(key=lambda r: r[0])
    return [c for c, _ in rows], [s["output_tok_s"] for _, s in rows], [s["tpot_ms"]["median"] for _, s in rows]


def plot(records: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tput, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for rec in records:
        label = f"kiln {rec.get('commit', '')[:7]}" if len(records) > 1 else "kiln"
        for side, style in (("server", "o-"), ("offline", "s--")):
            conc, tput, tpot = series(rec, side)
            if conc:
                ax_tput.plot(conc, tput, style, label=f"{label} {side}")
                ax_tpot.plot(conc, tpot, style, label=f"{label} {side}")
    first = records[0]
    for ax, ylabel in ((ax_tput, "output tokens / s"), (ax_tpot, "TPOT, median (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ticks = sorted({c for r in records for c in series(r, "server")[0]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
    fig.suptitle(f"{first.get('gpu', '')}: {first.get('input_len')} prompt + {first.get('output_len')} output "
                 f"tokens, greedy (build.py bench --workload server)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def markdown(records: list[dict]) -> str:
    lines = ["| workload | gpu | metric | kiln | roofline | peers | commit |", "|---|---|---|---|---|---|---|"]
    for r in records:
        roof = f"{r['roofline']['tok_s']:,.1f}" if r.get("roofline") else ""
        peers = ", ".join(f"{k} {p['value']:,.1f}" for k, p in (r.get("peers") or {}).items())
        if "engine" in r:  # a peer's own file
            lines.append(f"| {r['workload']} | {r['gpu']} | {r['metric']} | ({r['engine']}) {r['value']:,.1f} | "
                         f"| | {r['commit']} |")
            continue
        lines.append(f"| {r['workload']} | {r['gpu']} | {r['metric']} | {r['value']:,.1f} | {roof} | {peers} | "
                     f"{r['commit']} |")
        for lv in r.get("levels", []):
            s, o = lv["server"], lv.get("offline")
            off = f" (offline {o['output_tok_s']:,.1f} tok/s, TPOT {o['tpot_ms']['median']:.2f} ms)" if o else ""
            lines.append(f"| server c={lv['concurrency']} | | TTFT {s['ttft_ms']['median']:.1f} ms, TPOT "
                         f"{s['tpot_ms']['median']:.2f} ms | {s['output_tok_s']:,.1f} tok/s{off} | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSON written by `build.py bench --json`")
    ap.add_argument("--out", help="PNG to write (server runs only)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table of every file")
    a = ap.parse_args(argv)
    records = load(a.files)
    if a.markdown:
        print(markdown(records))
    if a.out:
        servers = [r for r in records if r.get("workload") == "server"]
        if not servers:
            print("error: none of these files is a server run", file=sys.stderr)
            return 1
        plot(servers, a.out)
        print(f"wrote {a.out}", file=sys.stderr)
    if not a.markdown and not a.out:
        ap.error("give --out PNG, --markdown, or both")
    return 0


if __name__ == "__main__":
    sys.exit(main())
