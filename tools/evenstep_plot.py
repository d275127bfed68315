#!/usr/bin/python3
"""Pictures for evenstep-report: per-rank phase bars over steps and the
arrival-skew histogram, from RUN_DIR/trace.json and RUN_DIR/report.json, plus
RUN_DIR/report.html showing them with the table.

`evenstep_plot.py preflight REPORT.json [OUT.png]`: evenstep-preflight's
figures, each rank's as its ratio to the figure's reference (the median
rank, or the better of two; the report's "reference"), outliers in red.
Uses Debian's python3-matplotlib; without it, says so and exits 0."""
import html
import json
import os
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("no pictures: install python3-matplotlib (apt install python3-matplotlib)")
    sys.exit(0)



def plot_preflight(path, out):
    report = json.load(open(path))
    if "reference" not in report:
        print(f"{path}: no 'reference' figures (an evenstep-preflight older than this tool "
              "wrote it): run evenstep-preflight again")
        sys.exit(2)
    # The figures evenstep-preflight judges, against the reference it judged them by.
    references = report["reference"]
    figures = [(k, v) for k, v in sorted(report["per_rank"].items()) if k in references]
    if not figures:
        print(f"{path}: no rank measured any figure; nothing to draw")
        sys.exit(2)
    flagged = {(f["metric"], r) for f in report["findings"] for r in f["ranks"]}
    world = report["world_size"]
    fig, axes = plt.subplots(len(figures), 1, figsize=(max(6, 0.5 * world + 3), 1.6 * len(figures) + 1),
                             sharex=True, squeeze=False)
    for ax, (name, values) in zip(axes[:, 0], figures):
        ref = references[name]
        ratios = [(v / ref if v is not None and ref else 0) for v in values]
        colors = ["#e15759" if (name, r) in flagged else "#4e79a7" for r in range(world)]
        ax.bar(range(world), ratios, color=colors)
        ax.axhline(1.0, color="#555", linewidth=0.8)
        ax.set_ylabel(name, rotation=0, ha="right", fontsize=8)
        ax.set_ylim(0, max(1.3, max(ratios) * 1.1))
    axes[-1, 0].set_xlabel("rank (bars: ratio to the reference: median rank, or the better of two; red: outlier)")
    axes[-1, 0].set_xticks(range(world))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print("wrote", out)


if len(sys.argv) > 1 and sys.argv[1] == "preflight":
    if len(sys.argv) < 3:
        print("usage: evenstep_plot.py preflight REPORT.json [OUT.png]")
        sys.exit(2)
    plot_preflight(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else
                   os.path.splitext(sys.argv[2])[0] + ".png")
    sys.exit(0)

run = sys.argv[1]
report = json.load(open(os.path.join(run, "report.json")))
events = json.load(open(os.path.join(run, "trace.json")))
phases = ["data", "compute", "sync_wait", "optimizer", "io", "eval", "other"]
io_names = {"checkpoint", "log"}
per = {}  # rank -> step -> phase -> ms
for e in events:
    if e.get("ph") != "X":
        continue
    name = e["name"]
    phase = "io" if name in io_names else (name if name in phases else "other")
    if name == "exchange":
        phase = "other"
    step = e.get("args", {}).get("step", 0)
    per.setdefault(e["pid"], {}).setdefault(step, {}).setdefault(phase, 0.0)
    per[e["pid"]][step][phase] += e.get("dur", 0) / 1e3

ranks = sorted(per)
fig, axes = plt.subplots(len(ranks), 1, figsize=(10, 1.8 * len(ranks) + 1), sharex=True, squeeze=False)
colors = {"data": "#4e79a7", "compute": "#59a14f", "sync_wait": "#e15759",
          "optimizer": "#f28e2b", "io": "#b07aa1", "eval": "#76b7b2", "other": "#bab0ac"}
for ax, rank in zip(axes[:, 0], ranks):
    steps = sorted(per[rank])
    bottom = [0.0] * len(steps)
    for phase in phases:
        values = [per[rank][s].get(phase, 0.0) for s in steps]
        ax.bar(steps, values, bottom=bottom, color=colors[phase], label=phase, width=0.9)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("rank %d\nms" % rank)
axes[0, 0].legend(ncol=len(phases), fontsize="small", loc="upper left", bbox_to_anchor=(0, 1.45))
axes[-1, 0].set_xlabel("step")
fig.tight_layout()
fig.savefig(os.path.join(run, "phases.png"), dpi=90)

fig, ax = plt.subplots(figsize=(8, 3.5))
skews = {}
for step in report["steps"]:
    for rank, ms in zip(ranks, step.get("arrival_ms", [])):
        skews.setdefault(rank, []).append(ms)
for rank in ranks:
    ax.hist(skews.get(rank, []), bins=30, alpha=0.6, label="rank %d" % rank)
ax.set_xlabel("arrival at the gradient sync relative to the median rank (ms)")
ax.set_ylabel("steps")
ax.legend(fontsize="small")
fig.tight_layout()
fig.savefig(os.path.join(run, "arrival_skew.png"), dpi=90)

# Peak memory per step and rank (the "memory" counter of each step).
memory = {}  # rank -> [(step, peak MB)]
for e in events:
    if e.get("name") == "memory" and e.get("ph") == "C":
        args = e.get("args", {})
        memory.setdefault(e["pid"], []).append((args.get("step", 0), args.get("peak_mb", 0.0)))
flagged = {m["rank"] for m in report.get("memory", [])}
fig, ax = plt.subplots(figsize=(8, 3.5))
for rank in sorted(memory):
    points = sorted(memory[rank])
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".",
            linewidth=2.5 if rank in flagged else 1.0,
            label="rank %d%s" % (rank, " (memory imbalance)" if rank in flagged else ""))
ax.set_xlabel("step")
ax.set_ylabel("peak memory in the step (MB)")
ax.set_ylim(bottom=0)
if memory:
    ax.legend(fontsize="small")
fig.tight_layout()
fig.savefig(os.path.join(run, "memory.png"), dpi=90)

rows = "".join(
    "<tr>" + "".join("<td>%s</td>" % html.escape("%.2f" % v if isinstance(v, float) else str(v))
                     for v in (r["rank"], r["steps"], r["step_ms_mean"], r["step_ms_p50"], r["step_ms_p95"],
                               r["data_ms"], r["compute_ms"], r["sync_wait_ms"], r["optimizer_ms"], r["io_ms"],
                               r.get("eval_ms", 0.0),
                               r.get("peak_memory_mb", r.get("peak_rss_mb", 0.0))))
    + "</tr>" for r in report["ranks"])
straggler = report.get("straggler")
verdict = ("rank %d is the straggler; it loses the time in %s" % (straggler["rank"], straggler["phase"])
           if straggler else "no straggler")
memory_verdict = "; ".join(
    "rank %d peaks at %.2fx the median rank's memory (its largest micro-batch %.2fx the median's)"
    % (m["rank"], m["ratio_to_median"], m["micro_batch_ratio"]) for m in report.get("memory", [])) \
    or "memory even across ranks"
with open(os.path.join(run, "report.html"), "w") as out:
    out.write("<!doctype html><title>evenstep report</title><h1>evenstep report</h1>"
              "<p>%s; balance efficiency %.3f%s</p><p>Memory: %s</p>"
              "<table border=1 cellpadding=4><tr><th>rank</th><th>steps</th><th>mean ms</th><th>p50</th>"
              "<th>p95</th><th>data</th><th>compute</th><th>sync wait</th><th>optimizer</th><th>io</th><th>eval</th>"
              "<th>peak MB</th></tr>%s</table>"
              "<h2>Phases per step</h2><img src=phases.png><h2>Arrival at the sync</h2><img src=arrival_skew.png>"
              "<h2>Peak memory per step</h2><img src=memory.png>"
              % (html.escape(verdict), report["balance_efficiency"],
                 ("; " + html.escape(report["periodic"])) if report.get("periodic") else "",
                 html.escape(memory_verdict), rows))
print("wrote %s/phases.png, %s/arrival_skew.png, %s/memory.png, %s/report.html" % (run, run, run, run))
