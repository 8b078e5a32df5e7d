"""The trajectory inspector in headless Chromium (Debian's `chromium`, driven by Playwright): a real three-step run
of the local launcher and an edited copy of it, served by `omrl inspect` on loopback; the run list, the comparison
chart of the two, a step's episodes and a filter, an episode's transcript and token view, each holding the stored
records' values; and the job API's mount refusing a browser without the token, then letting it in with `?token=`.

Screenshots of the main views go to $OMRL_INSPECTOR_SCREENSHOTS when set (docs/ keeps them:
`OMRL_INSPECTOR_SCREENSHOTS=docs pytest tests/e2e/test_inspector_browser.py`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.grpc_server import free_port
from services.common.run_state import RunState
from services.learner.episodes import episode_summary, read_step
from tests.support.api_process import JobApiProcess

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
WAIT_MS = 30_000
"""How long a check waits for a page that a click loads: beside a busy process the next page's table was not there yet
when it was counted."""
SETUP_HINT = "run scripts/setup.sh (it installs Debian's chromium and the dev extra's playwright)"
STEPS = 3
WIDTH = 1200


def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(f"no `chromium` on PATH: {SETUP_HINT}")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_tiny_model) -> tuple[Path, str, str]:
    """(root, run, its copy): a real run, and a copy whose metrics are the run's plus 0.25 reward."""
    root = tmp_path_factory.mktemp("inspect")
    name = f"corridor-{uuid.uuid4().hex[:6]}"
    settings = [
        f"model.path={warm_tiny_model}",
        "rollout.groups_per_step=4",
        "rollout.group_size=4",
        "logging.episodes_per_step=-1",
        "logging.trackers=[jsonl]",
    ]
    flags = ["--config", "configs/tiny_model_rl.yaml", "--plain", "--output_dir", str(root), "--run", name]
    flags += ["--learner.steps", str(STEPS), *(arg for s in settings for arg in ("--set", s))]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "services.launcher", "train", *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        RunState.connect(load_config(str(ROOT / "configs/tiny_model_rl.yaml"), [f"run={name}"])).reset()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    copy = f"{name}-edited"
    shutil.copytree(root / name, root / copy, ignore=shutil.ignore_patterns("pids.json", "checkpoints", "model"))
    edited = [{**m, "reward_mean": m["reward_mean"] + 0.25} for m in metrics_of(root / name)]
    (root / copy / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in edited))
    return root, name, copy


def metrics_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def inspector(runs):
    """`omrl inspect ROOT` on a free loopback port; its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "inspect", str(runs[0]), "--port", str(free_port())],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, f"omrl inspect said {line!r}{proc.stdout.read() if proc.poll() is not None else ''}"
        yield found.group(0)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def expect(locator):
    """Playwright's retrying assertions (imported here: without playwright, `browser` fails with the setup hint)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"no playwright: {SETUP_HINT}")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": WIDTH, "height": 800})
    yield context.new_page()
    context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    wanted = os.environ.get("OMRL_INSPECTOR_SCREENSHOTS")
    return Path(wanted) if wanted else tmp_path_factory.mktemp("shots")


def test_the_run_list_shows_both_runs_and_compares_them_on_one_chart(page, inspector, runs, shots):
    root, name, copy = runs
    page.goto(inspector)
    for run in (name, copy):
        row = page.locator(f'tr[data-run="{run}"]')
        assert row.locator(".status").inner_text() == "succeeded"
        assert row.locator("td.num").inner_text() == f"{STEPS} / {STEPS}"
    page.screenshot(path=shots / "inspector_runs.png")
    page.check(f'input[value="{name}"]')
    page.check(f'input[value="{copy}"]')
    page.click("text=compare the checked runs")
    page.wait_for_url(lambda url: url.endswith(f"/compare?run={name}&run={copy}"))
    chart = page.locator('.chart[data-title="reward"]')
    for run, folder in ((name, root / name), (copy, root / copy)):
        circles = chart.locator(f'g.series[data-run="{run}"] circle')
        expect(circles).to_have_count(STEPS, timeout=WAIT_MS)
        last = metrics_of(folder)[-1]
        assert float(circles.nth(STEPS - 1).get_attribute("data-value")) == pytest.approx(last["reward_mean"])
        assert f"step {STEPS}: reward_mean" in circles.nth(STEPS - 1).locator("title").text_content()
    page.screenshot(path=shots / "inspector_compare.png")


def test_a_steps_episodes_and_a_filter(page, inspector, runs, shots):
    root, name, _ = runs
    rows = read_step(root / name, 2)
    page.goto(inspector)
    page.click(f'tr[data-run="{name}"] a')
    page.click('.steps a:text-is("2")')
    expect(page.locator("tr.episode")).to_have_count(len(rows), timeout=WAIT_MS)
    first = page.locator("tr.episode").first
    assert first.locator('[data-key="reward"]').inner_text() == f"{rows[0]['reward']:.4f}"
    advantage = episode_summary(rows[0])["advantage_mean"]
    assert first.locator('[data-key="advantage_mean"]').inner_text() == f"{advantage:+.4f}"
    page.screenshot(path=shots / "inspector_step.png")
    page.select_option('select[name="success"]', "false")
    page.click('button:text-is("apply")')
    failed = [r["trajectory_id"] for r in rows if not r["success"]]
    page.wait_for_url(lambda url: "success=false" in url)
    expect(page.locator("tr.episode")).to_have_count(len(failed), timeout=WAIT_MS)
    assert page.locator("tr.episode").evaluate_all("rows => rows.map(r => r.dataset.trajectory)") == failed
    assert page.locator("#count").inner_text() == f"{len(failed)} of {len(rows)} recorded episodes"


def test_an_episodes_transcript_and_token_view(page, inspector, runs, shots):
    root, name, _ = runs
    rows = read_step(root / name, 2)
    row = max(rows, key=lambda r: (r["invalid_actions"] > 0, r["num_turns"]))  # one with an invalid action if any
    page.goto(f"{inspector}runs/{name}/steps/2/episodes/{row['trajectory_id']}")
    turns = page.locator(".turn[data-turn]")
    assert turns.count() == len(row["turns"])
    assert page.locator(".model-text").all_inner_texts() == [t["text"] for t in row["turns"]]
    assert page.locator('#outcome [data-key="reward"]').inner_text() == f"{row['reward']:.6g}"
    spans = page.locator("#tokens span")
    assert spans.count() == len(row["token_ids"])
    page.screenshot(path=shots / "inspector_episode.png", full_page=True)
    page.click('.modes a:text-is("advantage")')
    page.wait_for_url(lambda url: "mode=advantage" in url)
    assert page.locator("#tokens").get_attribute("data-mode") == "advantage" and "mode=advantage" in page.url
    t = row["turns"][0]["start"]
    title = page.locator("#tokens span").nth(t).get_attribute("title")
    assert f"advantage {row['advantages'][t]:+.4f}" in title
    assert f"rollout {row['rollout_logprobs'][t]:.4f} | learner {row['learner_logprobs'][t]:.4f}" in title
    page.locator("#tokens").screenshot(path=shots / "inspector_tokens.png")


def test_the_api_mount_refuses_a_browser_without_the_token_then_keeps_it_logged_in(page, tmp_path):
    token = f"token-{uuid.uuid4().hex}"
    api = JobApiProcess(tmp_path, free_port(), token).start()
    try:
        assert page.goto(f"{api.url}/inspect/").status == 401
        response = page.goto(f"{api.url}/inspect/?token={token}")
        assert response.status == 200 and page.url == f"{api.url}/inspect/"
        assert page.locator("h1").inner_text() == "Runs"
        assert page.goto(f"{api.url}/inspect/compare").status == 200  # the cookie, no token in the address
        cookie = page.context.cookies()[0]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and token not in cookie["value"]
    finally:
        api.stop()
