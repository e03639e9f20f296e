"""An HTML episode viewer: every candidate of every (role, turn) group of an episode, in one page.

Metrics say *that* a run learns or not; the viewer shows *why*: which prompts a role saw, what its K
candidates answered, which one the team committed to, and where the group carried no learning signal
(all rewards of the trainer's group equal, as the record's ``zero_variance`` says; a candidate's advantage
shows "n/a" where one episode does not determine it, see :mod:`verl_mas.recording`), failed to parse, or hit
an infrastructure error::

    python -m verl_mas.view runs/at_grpo_cpu --out runs/at_grpo_cpu/episodes.html --limit 500

It reads ``verl_mas.episode/1`` records (JSON lines, one episode per line; a directory is searched for
``episodes*.jsonl``) and writes one self-contained HTML file: the data is embedded as JSON, the CSS and
JS are inline, and nothing is fetched, so the page opens from disk, offline, and can be attached to a
bug report as is. Episode text is model output and may hold HTML; the page inserts it only as text
(``textContent``), never as markup, and the embedded JSON escapes ``<`` so no text can end the script.

Why a module of this size: the page template (HTML, CSS, JS) lives here as one string, so the page
stays a single self-contained file and the viewer needs nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import html
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "main", "read_episodes", "write_page"]

from verl_mas.recording import SCHEMA  # the record format this viewer reads (verl_mas.recording writes it)

#: The file names a directory input is searched for (recursively).
EPISODE_GLOB = "episodes*.jsonl"
#: At most this many bad lines are named in one error; the rest are counted.
_MAX_REPORTED = 5


def _episode_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob(EPISODE_GLOB) if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such file or directory. Pass a run directory (searched recursively "
                             f"for {EPISODE_GLOB}) or an episodes JSON-lines file.")
    return files


def _problem(line: str) -> tuple[dict | None, str]:
    """The record on one line, or why it is not a ``verl_mas.episode/1`` record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an episode object"
    if "schema" not in record:
        return None, "no 'schema' field"
    if record["schema"] != SCHEMA:
        return None, f"schema {record['schema']!r}, expected {SCHEMA!r}"
    return record, ""


def read_episodes(paths: Iterable[str | Path]) -> list[dict]:
    """All episode records of ``paths`` (files, or directories searched for ``episodes*.jsonl``), in order.

    Every line must be a ``verl_mas.episode/1`` record: a record of another format would render as a
    silently wrong page, so a bad line is refused. All bad lines are collected first (the first few
    named by ``file:line``) so one run of the viewer shows everything there is to fix.

    Raises:
        ValueError: a path does not exist, or some lines are not episode records.
    """
    episodes: list[dict] = []
    bad: list[str] = []
    n_bad = 0
    for file in _episode_files(paths):
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            record, problem = _problem(line)
            if record is not None:
                episodes.append(record)
                continue
            n_bad += 1
            if len(bad) < _MAX_REPORTED:
                bad.append(f"  {file}:{number}: {problem}")
    if n_bad:
        more = [f"  ... and {n_bad - len(bad)} more"] if n_bad > len(bad) else []
        raise ValueError("\n".join([
            f"{n_bad} line(s) are not {SCHEMA} episode records, so the viewer cannot show them:",
            *bad, *more,
            f"Fix: pass only the {EPISODE_GLOB} files a verl_mas run writes (one episode per line, each with "
            f'"schema": "{SCHEMA}"), or regenerate them with this version of verl_mas.',
        ]))
    return episodes


def _finite(value: Any) -> Any:
    """``value`` with NaN/inf replaced by null: JSON.parse rejects them, and the page would not load."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _script_json(episodes: list[dict]) -> str:
    """The episodes as JSON that is safe inside ``<script>``: ``<``, ``>``, ``&`` as ``\\u`` escapes.

    Inside a JSON document these characters only occur within strings, where the escapes mean the same
    thing, so the data is unchanged while no text (``</script>``, ``<!--``) can end or alter the script.
    ASCII-only output also survives lone surrogates in model output.
    """
    text = json.dumps(_finite(episodes), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_page(episodes: list[dict], out: Path) -> Path:
    """Write the viewer page for ``episodes`` to ``out`` (parents created); return ``out``."""
    out = Path(out)
    title = html.escape(f"{len(episodes)} episodes · verl_mas view")
    page = _TEMPLATE.replace("__TITLE__", title).replace("__EPISODES__", _script_json(episodes))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of episodes")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_mas.view", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="RUN_OR_FILE",
                        help=f"an episodes JSON-lines file, or a run directory searched for {EPISODE_GLOB}")
    parser.add_argument("--out", required=True, type=Path, help="the HTML file to write")
    parser.add_argument("--limit", type=_positive_int, default=None, help="keep only the last N episodes")
    args = parser.parse_args(argv)
    try:
        episodes = read_episodes(args.inputs)
    except ValueError as exc:
        raise SystemExit(f"verl_mas.view: {exc}") from None
    if not episodes:
        raise SystemExit(f"verl_mas.view: no episodes in {', '.join(map(str, args.inputs))}, so there is "
                         f"nothing to show. Fix: pass a run directory that holds {EPISODE_GLOB} files, or "
                         f"such a file with at least one {SCHEMA} record.")
    if args.limit:
        episodes = episodes[-args.limit:]
    write_page(episodes, args.out)
    print(f"wrote {args.out} ({len(episodes)} episodes)")


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title><link rel="icon" href="data:,">
<style>
:root{--ok:#1a7f37;--bad:#cf222e;--warn:#9a6700;--muted:#656d76;--line:#d0d7de;--hl:#dafbe1}
*{box-sizing:border-box}
body{margin:0;font:14px/1.4 system-ui,sans-serif;color:#1f2328;display:flex;height:100vh}
#sidebar{width:330px;flex:none;display:flex;flex-direction:column;border-right:1px solid var(--line)}
#filters{padding:.6em;display:grid;grid-template-columns:auto 1fr;gap:.3em .5em;align-items:center;
  border-bottom:1px solid var(--line)}
#filters select,#filters input{width:100%}
#episode-count{grid-column:1/-1;color:var(--muted)}
#episode-list{list-style:none;margin:0;padding:0;overflow-y:auto;flex:1}
.episode{padding:.35em .6em;border-bottom:1px solid #eee;cursor:pointer}
.episode:hover{background:#f6f8fa}.episode.selected{background:#ddf4ff}
.line{display:flex;gap:.5em;justify-content:space-between}.meta{color:var(--muted);font-size:12px}
.uid{overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.badge{border-radius:1em;padding:0 .5em;font-size:11px;border:1px solid;white-space:nowrap;margin-right:.3em}
.badge.success{color:var(--ok)}.badge.failure,.badge.parse{color:var(--bad)}
.badge.aborted,.badge.infra{color:var(--warn)}.badge.zero{color:var(--muted)}
#episode-view{flex:1;overflow:auto;padding:1em 1.5em}
h2{margin:.1em 0 .4em}h3{margin:1em 0 .3em;font-size:15px}
.cols{display:flex;gap:2em;flex-wrap:wrap;align-items:flex-start}
table.kv{border-collapse:collapse}table.kv th{text-align:left;font-weight:normal;color:var(--muted)}
table.kv td,table.kv th{padding:.05em .8em .05em 0;vertical-align:top}
.tree{display:grid;column-gap:.6em;margin-top:.5em}
.role-head{font-weight:600;padding:.3em;border-bottom:2px solid var(--line);margin-bottom:.5em}
.turn-head{color:var(--muted);padding-top:.4em}
.node,.ghost,.empty-cell{margin-bottom:.6em;min-width:0}
.node{border:1px solid var(--line);border-radius:6px;background:#fff}
.node-summary{padding:.4em .5em;cursor:pointer}.node-summary:hover{background:#f6f8fa}
.node-title{font-weight:600}.node-stats{color:var(--muted);font-size:12px}
.node.zero-variance{border-style:dashed}.node.parse-failed{border-color:var(--bad)}
.node.expanded{box-shadow:0 1px 8px rgba(0,0,0,.18)}
.path{background:var(--hl);border-left:3px solid var(--ok);padding:0 .3em;margin:.25em 0;font-size:12px}
.path.none{background:#fff8c5;border-color:var(--warn)}
.snippet{color:var(--muted);overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.ghost,.empty-cell{border:1px dashed var(--line);border-radius:6px;color:var(--muted);padding:.4em;font-size:12px}
.empty-cell{border-color:transparent}
.node-detail{border-top:1px solid var(--line);padding:.5em}
.candidates{display:grid;gap:.6em;overflow-x:auto}
.candidate{border:1px solid var(--line);border-radius:6px;padding:.4em;min-width:0}
.candidate.committed{border:2px solid var(--ok);background:#f6fff8}
.candidate.parse-failed .cand-head{color:var(--bad)}.candidate.infra-error .cand-head{color:var(--warn)}
.cand-head{font-weight:600;margin-bottom:.2em}
pre{white-space:pre-wrap;word-break:break-word;font:12px/1.35 ui-monospace,monospace;background:#f6f8fa;
  padding:.4em;margin:.3em 0;max-height:40em;overflow:auto}
pre.error{color:var(--bad)}.empty{color:var(--muted)}
</style></head>
<body>
<nav id="sidebar"><div id="filters">
<label for="filter-step">step</label><select id="filter-step"><option value="">all</option></select>
<label for="filter-workflow">workflow</label><select id="filter-workflow"><option value="">all</option></select>
<label for="filter-success">outcome</label><select id="filter-success"><option value="">all</option>
<option value="success">success</option><option value="failure">failure</option>
<option value="aborted">aborted</option></select>
<label for="filter-role">role</label><select id="filter-role"><option value="">all</option></select>
<label for="filter-search">task uid</label><input id="filter-search" type="search" placeholder="search">
<div id="episode-count"></div></div>
<ul id="episode-list"></ul></nav>
<main id="episode-view"></main>
<script type="application/json" id="episodes">__EPISODES__</script>
<script>
"use strict";
// All data enters the DOM through textContent (el()), never innerHTML: episode text is model output.
const EPISODES = JSON.parse(document.getElementById("episodes").textContent);
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
const fmt = (x) => (typeof x === "number" ? x.toFixed(3) : "n/a");
const show = (x) => (x === null || x === undefined ? "n/a" : typeof x === "number" ? fmt(x) : String(x));
function status(ep) {
  const o = ep.outcome || {};
  if (o.aborted) return "aborted";
  return typeof o.success === "number" && o.success > 0 ? "success" : "failure";
}
const stepKey = (ep) => (ep.step === null || ep.step === undefined ? "none" : String(ep.step));
function kvTable(rows) {
  const t = el("table", "kv");
  for (const [k, v] of rows) { const tr = el("tr"); tr.append(el("th", null, k), el("td", null, v)); t.append(tr); }
  return t;
}
function fillSelect(id, values) {
  const sel = $(id);
  for (const [value, text] of values) { const o = el("option", null, text); o.value = value; sel.append(o); }
}

// The list is built once; filtering only toggles `hidden`, so thousands of episodes stay fast.
const items = [];
let selected = -1, shownRole = "", open = null;
function buildList() {
  const frag = document.createDocumentFragment();
  EPISODES.forEach((ep, i) => {
    const st = status(ep), li = el("li", "episode"), top = el("div", "line"), meta = el("div", "line meta");
    li.dataset.episode = String(i);
    top.append(el("span", "wf", ep.workflow), el("span", "badge " + st, st));
    meta.append(el("span", "uid", ep.task_uid), el("span", null, "step " + (ep.step ?? "none")),
                el("span", null, ep.source));
    li.append(top, meta);
    frag.append(li);
    items.push({li, ep, st, step: stepKey(ep), uid: String(ep.task_uid).toLowerCase(), roles: new Set(ep.roles)});
  });
  $("episode-list").append(frag);
  const steps = [...new Set(items.map((it) => it.step))].sort((a, b) =>
    a === "none" ? 1 : b === "none" ? -1 : Number(a) - Number(b));
  fillSelect("filter-step", steps.map((s) => [s, s]));
  fillSelect("filter-workflow", [...new Set(EPISODES.map((e) => e.workflow))].sort().map((w) => [w, w]));
  fillSelect("filter-role", [...new Set(EPISODES.flatMap((e) => e.roles))].sort().map((r) => [r, r]));
}
// The role filter also hides episodes without that role: their tree would be empty.
function applyFilters() {
  const step = $("filter-step").value, wf = $("filter-workflow").value, su = $("filter-success").value;
  const role = $("filter-role").value, q = $("filter-search").value.trim().toLowerCase();
  let n = 0, first = -1;
  items.forEach((it, i) => {
    const ok = (!step || it.step === step) && (!wf || it.ep.workflow === wf) && (!su || it.st === su)
      && (!role || it.roles.has(role)) && (!q || it.uid.includes(q));
    if (it.li.hidden === ok) it.li.hidden = !ok;
    if (ok) { n++; if (first < 0) first = i; }
  });
  $("episode-count").textContent = `${n} of ${items.length} episodes`;
  if (selected < 0 || items[selected].li.hidden) select(first);
  else if (role !== shownRole) select(selected);
}
function select(i) {
  if (selected >= 0) items[selected].li.classList.remove("selected");
  selected = i;
  if (i >= 0) { items[i].li.classList.add("selected"); items[i].li.scrollIntoView({block: "nearest"}); }
  renderEpisode(i);
}

function renderEpisode(i) {
  const view = $("episode-view");
  view.replaceChildren();
  open = null;
  shownRole = $("filter-role").value;
  if (i < 0) { view.append(el("p", "empty", "No episode matches the filters.")); return; }
  const ep = EPISODES[i], o = ep.outcome || {}, st = status(ep);
  const h2 = el("h2", null, `${ep.workflow} · ${ep.task_uid} `);
  h2.append(el("span", "badge " + st, st));
  const flags = ["terminated", "truncated", "aborted", "context_overflow"].filter((f) => o[f]).join(", ");
  const facts = kvTable([["step", ep.step ?? "none"], ["source", ep.source], ["seed", ep.seed ?? "n/a"],
    ["success", show(o.success)], ["ended", flags || "n/a"], ["groups", (ep.groups || []).length]]);
  const metrics = Object.keys(ep.metrics || {}).sort().map((k) => [k, show(ep.metrics[k])]);
  const policies = (ep.roles || []).map((r) => [r, (ep.policies || {})[r] ?? "n/a"]);
  const cols = el("div", "cols");
  for (const [name, table] of [["episode", facts], ["metrics", kvTable(metrics)], ["policies", kvTable(policies)]]) {
    const c = el("div"); c.append(el("h3", null, name), table); cols.append(c);
  }
  view.append(h2, cols);
  if (o.error) view.append(el("pre", "error", o.error));
  const task = el("details", "task");
  task.append(el("summary", null, "task"), el("pre", null, JSON.stringify(ep.task, null, 2)));
  view.append(task, el("h3", null, "turns × roles (click a node for its candidates)"), renderTree(ep, shownRole));
}

// One row per turn, one column per role. Grid rows come in pairs: turn k's nodes sit in row 2+2k and
// an expanded node moves to row 3+2k spanning all role columns (a ghost keeps its place in the grid).
function renderTree(ep, role) {
  const roles = role ? (ep.roles || []).filter((r) => r === role) : ep.roles || [];
  const groups = (ep.groups || []).filter((g) => roles.includes(g.role));
  const turns = [...new Set(groups.map((g) => g.turn))].sort((a, b) => a - b);
  const at = new Map(groups.map((g) => [g.role + "\u0000" + g.turn, g]));
  const tree = el("div", "tree");
  tree.style.gridTemplateColumns = `4.5em repeat(${roles.length}, minmax(13em, 1fr))`;
  const place = (e, col, row) => { e.style.gridColumn = String(col); e.style.gridRow = String(row); tree.append(e); };
  roles.forEach((r, c) => place(el("div", "role-head", r), c + 2, 1));
  turns.forEach((t, k) => {
    place(el("div", "turn-head", "turn " + t), 1, 2 + 2 * k);
    roles.forEach((r, c) => {
      const g = at.get(r + "\u0000" + t);
      place(g ? buildNode(g, k, c) : el("div", "empty-cell", "—"), c + 2, 2 + 2 * k);
    });
  });
  if (!groups.length) tree.append(el("p", "empty", "No groups for this role."));
  return tree;
}
// Whether the trainer's group of a node carried no signal (several members, equal rewards: advantage 0 for
// each). The recorder says so in zero_variance, null where one episode does not hold the group (parallel
// sampling: it spans the task's episodes), and under role-only grouping the group is the role's, not the node's.
// Records written before the field: a node whose trainable candidates have advantages was its own group.
function zeroVariance(g) {
  if ("zero_variance" in g) return g.zero_variance === true;
  const members = (g.candidates || []).filter((x) => x.trainable !== false);
  return members.length > 1 && members.every((x) => typeof x.advantage === "number" && x.reward === members[0].reward);
}
function buildNode(g, k, c) {
  const cands = g.candidates || [], rewards = cands.map((x) => x.reward);
  const nums = rewards.filter((r) => typeof r === "number");
  const node = el("div", "node"), sum = el("div", "node-summary");
  node.dataset.node = g.key;
  const zero = zeroVariance(g);
  const parse = cands.some((x) => x.parse_failed), infra = cands.some((x) => x.infra_error);
  const lo = Math.min(...nums), hi = Math.max(...nums);
  const range = !nums.length ? "n/a" : lo === hi ? fmt(lo) : `${fmt(lo)} … ${fmt(hi)}`;
  sum.append(el("div", "node-title", `${g.role} · turn ${g.turn}`),
             el("div", "node-stats", `K=${cands.length} · reward ${range}`));
  const com = cands.find((x) => x.committed);
  const path = el("div", com ? "path" : "path none",
                  com ? `committed #${com.index}: reward ${fmt(com.reward)}` : "no committed candidate");
  if (com) path.append(el("div", "snippet", com.text));
  sum.append(path);
  const badges = el("div");
  if (zero) { node.classList.add("zero-variance"); badges.append(el("span", "badge zero", "zero variance")); }
  if (parse) { node.classList.add("parse-failed"); badges.append(el("span", "badge parse", "parse failure")); }
  if (infra) { node.classList.add("infra-failed"); badges.append(el("span", "badge infra", "infra failure")); }
  if (badges.childElementCount) sum.append(badges);
  node.append(sum);
  sum.addEventListener("click", () => toggle(node, g, k, c));
  return node;
}
function collapse() {
  if (!open) return;
  open.detail.remove(); open.ghost.remove();
  open.node.classList.remove("expanded");
  open.node.style.gridColumn = String(open.c + 2); open.node.style.gridRow = String(2 + 2 * open.k);
  open = null;
}
function toggle(node, g, k, c) {
  const same = open && open.node === node;
  collapse();
  if (same) return;
  const ghost = el("div", "ghost", `${g.role} · turn ${g.turn}: expanded below`);
  ghost.style.gridColumn = String(c + 2); ghost.style.gridRow = String(2 + 2 * k);
  node.parentNode.insertBefore(ghost, node);
  node.style.gridColumn = "2 / -1"; node.style.gridRow = String(3 + 2 * k);
  node.classList.add("expanded");
  const detail = buildDetail(g);
  node.append(detail);
  open = {node, ghost, detail, k, c};
}
function buildDetail(g) {
  const cands = g.candidates || [], detail = el("div", "node-detail"), prompt = el("details", "prompt");
  prompt.open = true;
  prompt.append(el("summary", null, `prompt (${g.prompt_tokens ?? "?"} tokens)`), el("pre", null, g.prompt ?? ""));
  const row = el("div", "candidates");
  row.style.gridTemplateColumns = `repeat(${Math.max(1, cands.length)}, minmax(16em, 1fr))`;
  for (const x of cands) {
    const card = el("div", "candidate");
    card.dataset.candidate = String(x.index);
    const marks = [];
    if (x.committed) { card.classList.add("committed"); marks.push("committed"); }
    if (x.parse_failed) { card.classList.add("parse-failed"); marks.push("parse failure"); }
    if (x.infra_error) { card.classList.add("infra-error"); marks.push("infra error"); }
    if (x.trainable === false) marks.push("not trainable");
    card.append(el("div", "cand-head", [`#${x.index}`, ...marks].join(" · ")));
    const t = el("table", "kv");
    for (const [name, cls, value] of [["reward", "reward", fmt(x.reward)], ["team", "team-reward", fmt(x.team_reward)],
        ["local", "local-reward", fmt(x.local_reward)], ["advantage", "advantage", fmt(x.advantage)],
        ["tokens", "response-tokens", x.response_tokens ?? "n/a"], ["stop", "stop-reason", x.stop_reason ?? "n/a"]]) {
      const tr = el("tr"); tr.append(el("th", null, name), el("td", cls, value)); t.append(tr);
    }
    card.append(t);
    if (x.infra_error) card.append(el("pre", "error", x.infra_error));
    card.append(el("pre", "text", x.text ?? ""));
    row.append(card);
  }
  detail.append(prompt, row);
  return detail;
}

for (const id of ["filter-step", "filter-workflow", "filter-success", "filter-role"]) $(id).addEventListener("change", applyFilters);
$("filter-search").addEventListener("input", applyFilters);
$("episode-list").addEventListener("click", (e) => {
  const li = e.target.closest("[data-episode]");
  if (li) select(Number(li.dataset.episode));
});
buildList();
applyFilters();
</script>
</body></html>
"""

if __name__ == "__main__":
    main()
