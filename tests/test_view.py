"""The episode viewer (``python -m verl_mas.view``): its reading and embedding in Python, its page in Chromium.

The unit tests check what the page is built from (records in, the same records embedded out, bad lines
refused by file:line); the browser test checks that the page works as a page: it loads without console
errors, lists and filters episodes, and shows a node's candidates with the right rewards and marks.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from verl_mas.view import SCHEMA, main, read_episodes, write_page

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
_EMBEDDED = re.compile(r'<script type="application/json" id="episodes">(.*?)</script>', re.S)


def _candidate(index: int, reward: float | None, *, committed: bool = False, parse_failed: bool = False,
               infra_error: str | None = None, text: str | None = None) -> dict:
    return {"index": index, "text": text if text is not None else f"answer {index}", "reward": reward,
            "team_reward": None if reward is None else reward / 2, "local_reward": None if reward is None else reward / 2,
            "advantage": None if reward is None else reward - 0.5, "committed": committed,
            "parse_failed": parse_failed, "infra_error": infra_error, "trainable": infra_error is None,
            "response_tokens": 3, "stop_reason": "completed"}


def _group(uid: str, role: str, turn: int, candidates: list[dict]) -> dict:
    return {"key": f"{uid}|{role}|{turn}", "role": role, "turn": turn, "prompt": f"{role} prompt at turn {turn}",
            "prompt_tokens": 12, "candidates": candidates}


def _episode(uid: str, groups: list[dict], *, success: float | None = 1.0, aborted: bool = False,
             error: str | None = None, step: int | None = 3, workflow: str = "relay-v0",
             source: str = "train", roles: tuple[str, ...] = ("caller", "runner")) -> dict:
    return {"schema": SCHEMA, "source": source, "step": step, "workflow": workflow, "task_uid": uid, "seed": 7,
            "task": {"question": f"task {uid}"}, "roles": list(roles), "policies": {r: r for r in roles},
            "outcome": {"success": success, "terminated": not aborted, "truncated": False, "aborted": aborted,
                        "error": error, "context_overflow": False},
            "metrics": {"mas/success": success if success is not None else 0.0, "mas/delivered": 0.5},
            "groups": groups}


def _four(uid: str, rewards: list[float | None], committed: int | None = 0, **marks: int) -> list[dict]:
    """K candidates with ``rewards``; ``committed`` is the committed index; marks: parse_failed=i, infra=i."""
    return [_candidate(i, r, committed=i == committed, parse_failed=marks.get("parse_failed") == i,
                       infra_error="server error 503" if marks.get("infra") == i else None)
            for i, r in enumerate(rewards)]


def _hand_episodes() -> list[dict]:
    """One success, one failure with a parse failure, one aborted with an infra error, one zero-variance."""
    return [
        _episode("ok", [_group("ok", "caller", 0, _four("ok", [1.0, 0.0, 0.25, 0.5], committed=0)),
                        _group("ok", "runner", 0, _four("ok", [1.0, 1.0, 0.0, 0.0], committed=1))]),
        _episode("bad", [_group("bad", "caller", 0, _four("bad", [0.0, 0.5, 0.0, 0.0], committed=1, parse_failed=0))],
                 success=0.0, step=4),
        _episode("abort", [_group("abort", "caller", 0, _four("abort", [1.0, 0.0, 0.0, 0.0], committed=0)),
                           _group("abort", "runner", 0, _four("abort", [None, 0.0, 0.0, 0.0], committed=None,
                                                                infra=0))],
                 success=None, aborted=True, error="InfraError: server error 503", step=4, workflow="math-v0"),
        _episode("flat", [_group("flat", "caller", 0, _four("flat", [0.5, 0.5, 0.5, 0.5], committed=2,
                                                             text=None))], step=5),
    ]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _embedded(page: Path) -> list[dict]:
    scripts = _EMBEDDED.findall(page.read_text())
    assert len(scripts) == 1, "the page must hold exactly one embedded episodes script"
    return json.loads(scripts[0])


# ---- unit: reading, embedding, the CLI ----

def test_main_writes_a_page_whose_embedded_json_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    episodes = _hand_episodes()
    src = _write_jsonl(tmp_path / "episodes.jsonl", episodes)
    out = tmp_path / "out" / "page.html"
    main([str(src), "--out", str(out)])
    assert capsys.readouterr().out.strip() == f"wrote {out} (4 episodes)"
    assert _embedded(out) == episodes
    assert read_episodes([src]) == episodes
    page = out.read_text()
    # Self-contained: no external resources.
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)


def test_script_close_in_model_text_cannot_break_the_page(tmp_path: Path) -> None:
    episodes = _hand_episodes()
    hostile = "</script><script>alert(1)</script> <!-- <script> & </SCRIPT >"
    episodes[0]["groups"][0]["candidates"][1]["text"] = hostile
    episodes[1]["groups"][0]["prompt"] = hostile
    page = write_page(episodes, tmp_path / "page.html")
    html = page.read_text()
    assert html.count("</script>") == 2, "only the page's own two script tags may close"
    assert "alert(1)" in html  # the text is there, escaped, not dropped
    assert _embedded(page) == episodes


def test_non_finite_metrics_embed_as_null(tmp_path: Path) -> None:
    episodes = _hand_episodes()[:1]
    episodes[0]["metrics"]["mas/delivered"] = float("nan")
    assert _embedded(write_page(episodes, tmp_path / "p.html"))[0]["metrics"]["mas/delivered"] is None


def test_bad_lines_are_refused_by_file_and_line(tmp_path: Path) -> None:
    good = _hand_episodes()[0]
    src = tmp_path / "episodes.jsonl"
    src.write_text("\n".join([json.dumps(good), json.dumps({**good, "schema": "verl_mas.episode/0"}),
                              json.dumps({k: v for k, v in good.items() if k != "schema"}), "{not json", "",
                              json.dumps(good)]) + "\n")
    with pytest.raises(SystemExit) as exc:
        main([str(src), "--out", str(tmp_path / "p.html")])
    message = str(exc.value)
    assert "3 line(s)" in message
    assert f"{src}:2: schema 'verl_mas.episode/0'" in message
    assert f"{src}:3: no 'schema' field" in message
    assert f"{src}:4: not JSON" in message
    assert f"{src}:1" not in message and f"{src}:6" not in message
    assert "Fix:" in message
    assert not (tmp_path / "p.html").exists()
    with pytest.raises(ValueError, match=re.escape(f"{src}:2")):
        read_episodes([src])


def test_a_directory_is_searched_recursively_for_episode_files(tmp_path: Path) -> None:
    a, b, c, d = _hand_episodes()
    _write_jsonl(tmp_path / "run" / "b" / "deep" / "episodes-val.jsonl", [c])
    _write_jsonl(tmp_path / "run" / "a" / "episodes.jsonl", [a, b])
    _write_jsonl(tmp_path / "run" / "metrics.jsonl", [{"step": 1, "data": {}}])  # not an episodes file
    _write_jsonl(tmp_path / "run" / "other.jsonl", [{"schema": "x"}])
    extra = _write_jsonl(tmp_path / "extra.jsonl", [d])
    assert [e["task_uid"] for e in read_episodes([tmp_path / "run", extra])] == ["ok", "bad", "abort", "flat"]


def test_limit_keeps_the_last_episodes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    episodes = _hand_episodes()
    src = _write_jsonl(tmp_path / "episodes.jsonl", episodes)
    out = tmp_path / "p.html"
    main([str(src), "--out", str(out), "--limit", "2"])
    assert capsys.readouterr().out.strip() == f"wrote {out} (2 episodes)"
    assert [e["task_uid"] for e in _embedded(out)] == ["abort", "flat"]
    main([str(src), "--out", str(out), "--limit", "10"])
    assert len(_embedded(out)) == 4


def test_no_episodes_and_missing_paths_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(SystemExit, match="no episodes in .*empty_run.*Fix:"):
        main([str(tmp_path / "empty_run"), "--out", str(tmp_path / "p.html")])
    with pytest.raises(SystemExit, match="missing.jsonl: no such file or directory"):
        main([str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p.html")])


# ---- browser: the page in headless Chromium ----

def _browser_episodes() -> list[dict]:
    """200 episodes. Episode 0 is hand-made; the rest follow rules whose filter counts are computed by hand.

    Episode i: workflow relay-v0 if i is even else math-v0; outcome by i % 5: 0, 1 success; 2, 3 failure;
    4 aborted; step i // 20. So 80 failures (2 in 5), and 40 failed relay-v0 episodes (i % 10 in {2, 8}).
    """
    episodes = []
    for i in range(200):
        kind = ("success", "success", "failure", "failure", "aborted")[i % 5]
        workflow = "relay-v0" if i % 2 == 0 else "math-v0"
        uid = f"t{i:03d}"
        if i == 0:
            # 3 turns x 2 roles = 6 nodes; caller turn 1 has zero variance; runner turn 0 a parse failure.
            groups = [_group(uid, "caller", 0, _four(uid, [1.0, 0.0, 0.25, 0.5], committed=2)),
                      _group(uid, "runner", 0, _four(uid, [0.0, 1.0, 0.0, 0.0], committed=1, parse_failed=3)),
                      _group(uid, "caller", 1, _four(uid, [0.5, 0.5, 0.5, 0.5], committed=0)),
                      _group(uid, "runner", 1, _four(uid, [1.0, None, 0.0, 0.75], committed=3)),
                      _group(uid, "caller", 2, _four(uid, [0.0, 1.0, 0.0, 1.0], committed=1)),
                      _group(uid, "runner", 2, _four(uid, [1.0, 0.0, 0.0, 0.0], committed=0))]
            groups[1]["candidates"][0]["text"] = '<img src=x onerror="console.error(1)"></script>'
        else:
            k = 1 if i % 7 == 0 else 4
            groups = [_group(uid, role, turn, _four(uid, [((i + j) % 4) / 4 for j in range(k)],
                                                    committed=None if kind == "aborted" and turn == 1 else 0,
                                                    infra=0 if kind == "aborted" and turn == 1 else None))
                      for turn in range(2) for role in ("caller", "runner")]
        episodes.append(_episode(uid, groups, success={"success": 1.0, "failure": 0.0, "aborted": None}[kind],
                                 aborted=kind == "aborted", step=i // 20, workflow=workflow,
                                 source="train" if i % 3 else "val"))
    return episodes


@pytest.fixture
def chromium():
    """A headless Chromium driven by the system chromedriver (no download: Selenium Manager cannot reach out)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.path.exists(p) and os.access(p, os.X_OK))]
    if missing:
        pytest.fail(f"the browser test needs {' and '.join(missing)}, which are missing. "
                    f"Fix: apt-get install chromium chromium-driver", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the browser test needs selenium. Fix: pip install selenium (the project's test extra)",
                    pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _visible(driver, selector: str) -> int:
    """How many elements match ``selector`` and are rendered (have a layout box)."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].filter(e => e.getClientRects().length).length",
        selector)


@pytest.mark.slow
def test_the_page_in_chromium(chromium, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    started = time.monotonic()
    driver = chromium
    episodes = _browser_episodes()
    page = write_page(episodes, tmp_path / "episodes.html")
    driver.get(page.resolve().as_uri())

    assert driver.find_element(By.ID, "episode-count").text == "200 of 200 episodes"
    assert _visible(driver, "[data-episode]") == 200
    first = driver.find_element(By.CSS_SELECTOR, '[data-episode="0"]')
    assert "selected" in first.get_attribute("class")
    view = driver.find_element(By.ID, "episode-view")
    assert "t000" in view.find_element(By.TAG_NAME, "h2").text
    nodes = view.find_elements(By.CSS_SELECTOR, "[data-node]")
    assert len(nodes) == 6
    flagged = {cls: sorted(n.get_attribute("data-node") for n in nodes if cls in n.get_attribute("class").split())
               for cls in ("zero-variance", "parse-failed")}
    assert flagged == {"zero-variance": ["t000|caller|1"], "parse-failed": ["t000|runner|0"]}

    node = view.find_element(By.CSS_SELECTOR, '[data-node="t000|runner|1"]')
    node.click()
    cands = node.find_elements(By.CSS_SELECTOR, "[data-candidate]")
    assert [c.get_attribute("data-candidate") for c in cands] == ["0", "1", "2", "3"]
    assert [c.find_element(By.CSS_SELECTOR, ".reward").text for c in cands] == ["1.000", "n/a", "0.000", "0.750"]
    committed = node.find_elements(By.CSS_SELECTOR, "[data-candidate].committed")
    assert [c.get_attribute("data-candidate") for c in committed] == ["3"]
    assert node.find_element(By.CSS_SELECTOR, ".prompt pre").text == "runner prompt at turn 1"

    # Model output with markup stays text: the img is not an element, and it logs nothing.
    other = view.find_element(By.CSS_SELECTOR, '[data-node="t000|runner|0"]')
    other.click()
    assert not node.find_elements(By.CSS_SELECTOR, "[data-candidate]"), "opening a node closes the previous one"
    text = other.find_element(By.CSS_SELECTOR, '[data-candidate="0"] pre.text')
    assert text.text.startswith("<img src=x")
    assert not view.find_elements(By.CSS_SELECTOR, "img")
    assert len(other.find_elements(By.CSS_SELECTOR, "[data-candidate].parse-failed")) == 1

    artifacts = Path(os.environ["VERL_MAS_ARTIFACTS"]) if os.environ.get("VERL_MAS_ARTIFACTS") else tmp_path
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "view.png"
    driver.save_screenshot(str(shot))
    print(f"[view] screenshot: {shot}")

    Select(driver.find_element(By.ID, "filter-success")).select_by_value("failure")
    assert driver.find_element(By.ID, "episode-count").text == "80 of 200 episodes"
    Select(driver.find_element(By.ID, "filter-workflow")).select_by_value("relay-v0")
    assert driver.find_element(By.ID, "episode-count").text == "40 of 200 episodes"
    assert _visible(driver, "[data-episode]") == 40
    # The first visible failure (episode 2) is selected in place of the hidden episode 0.
    assert "t002" in driver.find_element(By.CSS_SELECTOR, "#episode-view h2").text
    search = driver.find_element(By.ID, "filter-search")
    search.send_keys("t01")  # relay failures among t010..t019: t012, t018
    assert _visible(driver, "[data-episode]") == 2
    search.send_keys(Keys.BACKSPACE * 3)
    Select(driver.find_element(By.ID, "filter-step")).select_by_value("3")  # i in 60..79: 62, 68, 72, 78
    assert driver.find_element(By.ID, "episode-count").text == "4 of 200 episodes"
    Select(driver.find_element(By.ID, "filter-role")).select_by_value("runner")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#episode-view [data-node]")) == 2  # runner, turns 0 and 1

    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, f"browser console errors: {severe}"
    assert time.monotonic() - started < 30



# ---- the page's script in Node, on a minimal DOM (no browser needed) ----

# Just the DOM the page's script uses; every element is recorded so a test can read the tree back.
_NODE_DOM = r"""
const vm = require("vm");
const [page, calls] = [require("fs").readFileSync(process.argv[2], "utf8"), JSON.parse(process.argv[3])];
class Element {
  constructor(tag) { Object.assign(this, {tagName: tag, children: [], parentNode: null, dataset: {}, style: {},
    className: "", textContent: "", hidden: false, value: "", open: false}); }
  get classList() {
    const names = () => this.className.split(" ").filter(Boolean);
    return {add: (c) => { this.className = [...new Set([...names(), c])].join(" "); },
            remove: (c) => { this.className = names().filter((n) => n !== c).join(" "); }};
  }
  get childElementCount() { return this.children.length; }
  append(...kids) { for (const k of kids) { k.remove(); k.parentNode = this; this.children.push(k); } }
  replaceChildren(...kids) { for (const k of [...this.children]) k.remove(); this.append(...kids); }
  insertBefore(k, ref) { k.remove(); k.parentNode = this; this.children.splice(this.children.indexOf(ref), 0, k); }
  remove() { if (this.parentNode) this.parentNode.children.splice(this.parentNode.children.indexOf(this), 1);
             this.parentNode = null; }
  addEventListener() {}
  scrollIntoView() {}
  all() { return [this, ...this.children.flatMap((k) => k.all())]; }
}
const byId = {};
const document = {
  getElementById: (id) => (byId[id] ??= new Element("div")),
  createElement: (tag) => new Element(tag),
  createDocumentFragment: () => new Element("fragment"),
};
const script = page.match(/<script type="application\/json" id="episodes">([\s\S]*?)<\/script>/)[1];
document.getElementById("episodes").textContent = script;
const code = page.match(/<script>([\s\S]*?)<\/script>/)[1];
const context = vm.createContext({document, console});
vm.runInContext(code, context);
const out = {};
for (const i of calls) {
  vm.runInContext(`select(${i})`, context);
  const nodes = document.getElementById("episode-view").all().filter((e) => e.dataset.node)
    .map((e) => [e.dataset.node, e.className.split(" ").filter(Boolean).sort()]);
  // A node's candidate cards (what a click shows): each candidate's advantage as the page prints it.
  const advantages = vm.runInContext(`EPISODES[${i}].groups.map((g) => [g.key, buildDetail(g)])`, context)
    .map(([key, detail]) => [key, detail.all().filter((e) => e.className === "advantage").map((e) => e.textContent)]);
  out[i] = {nodes: Object.fromEntries(nodes), advantages: Object.fromEntries(advantages)};
}
console.log(JSON.stringify(out));
"""


def _node_marks(tmp_path: Path, episodes: list[dict]) -> dict[str, dict[str, dict[str, list[str]]]]:
    """Per episode, ``{"nodes": {key: classes}, "advantages": {key: texts}}``: its nodes as the page's own script
    renders them and the advantage each candidate card prints (run by Node)."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.fail("this test runs the page's script in Node, which is missing. Fix: apt-get install nodejs",
                    pytrace=False)
    page = write_page(episodes, tmp_path / "page.html")
    shim = tmp_path / "dom.js"
    shim.write_text(_NODE_DOM)
    proc = subprocess.run([node, str(shim), str(page), json.dumps(list(range(len(episodes))))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {episodes[int(i)]["task_uid"]: shown for i, shown in json.loads(proc.stdout).items()}


@pytest.mark.slow  # a child interpreter (Node)
def test_the_zero_variance_mark_is_the_trainer_group_the_record_names(tmp_path: Path) -> None:
    """The page marks a node "zero variance" when its record says the trainer's group had no signal, not when
    the node's own rewards tie: under role-only grouping a tied node sits in a role group that has signal, and
    under parallel sampling the group spans episodes (the record holds null)."""
    def grouped(uid: str, role: str, turn: int, rewards: list[float], zero: bool | None,
                advantages: list[float | None]) -> dict:
        g = _group(uid, role, turn, _four(uid, rewards))
        g["zero_variance"] = zero
        for c, a in zip(g["candidates"], advantages, strict=True):
            c["advantage"] = a
        return g

    episodes = [
        # agent grouping: caller rewards [1, 1 | 1, 0] over turns 0 and 1; mean 3/4, std 1/2, so the tied
        # turn-0 node gets +1/2 each (no mark), the runner's role group is tied everywhere (marked).
        _episode("agent", [grouped("agent", "caller", 0, [1.0, 1.0], False, [0.5, 0.5]),
                           grouped("agent", "caller", 1, [1.0, 0.0], False, [0.5, -1.5]),
                           grouped("agent", "runner", 0, [0.0, 0.0], True, [0.0, 0.0]),
                           grouped("agent", "runner", 1, [0.0, 0.0], True, [0.0, 0.0])]),
        # parallel sampling (one candidate per node): the group spans the task's episodes, whose rewards the
        # record cannot see; null, and no mark.
        _episode("parallel", [grouped("parallel", "caller", 0, [1.0], None, [None]),
                              grouped("parallel", "runner", 0, [0.0], None, [None])]),
        # A record written before zero_variance existed (agent_turn advantages): the node is its group.
        _episode("legacy", [_group("legacy", "caller", 0, _four("legacy", [0.5, 0.5])),
                            _group("legacy", "runner", 0, _four("legacy", [0.5, 1.0]))]),
    ]
    shown = _node_marks(tmp_path, episodes)
    zero = {uid: sorted(k for k, classes in s["nodes"].items() if "zero-variance" in classes)
            for uid, s in shown.items()}
    assert zero == {"agent": ["agent|runner|0", "agent|runner|1"], "parallel": [], "legacy": ["legacy|caller|0"]}
    # Every node was rendered (the marks above are not missing nodes).
    assert {uid: len(s["nodes"]) for uid, s in shown.items()} == {"agent": 4, "parallel": 2, "legacy": 2}
    # A null advantage prints n/a, a recorded one its value.
    assert shown["parallel"]["advantages"] == {"parallel|caller|0": ["n/a"], "parallel|runner|0": ["n/a"]}
    assert shown["agent"]["advantages"]["agent|caller|1"] == ["0.500", "-1.500"]
