"""``vlm-focus demo`` end to end: a real server process, Debian's Chromium driven by Playwright,
and five concurrent requests through gradio_client; a second server, on a tiny random-weight
Qwen2.5-VL saved with its real processor, answers about a video uploaded in the browser.

Playwright never downloads a browser here: it launches the system ``chromium`` (``.ci/run``
installs it with apt-get when it is missing). Without it these tests fail and say so.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from organism import default_model_path, sample_scene_paths
from organism.scenes import CATEGORIES

QUESTION = "Is there a red_circle in the image?"  # absent from the first sample: "not found"
PRESENT = "Is there a green_square in the image?"
SQUARE = (92, 62, 33, 32)  # the green_square's box in the first sample (scene_9000001)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
STARTUP_SECONDS = 180


def chromium_path() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        pytest.fail(
            "Chromium is missing: install Debian's browser with "
            "`apt-get install -y chromium chromium-driver` (.ci/run does this); "
            "Playwright is used with the system browser and never downloads one."
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def n_visual(model_dir: Path) -> int:
    vision = json.loads((model_dir / "config.json").read_text())["vision_config"]
    return (vision["image_size"] // vision["patch_size"]) ** 2


@contextlib.contextmanager
def demo_server(log: Path, *options: str):
    """The demo as a user starts it: ``python -m vlm_focus.cli demo --port N [options]``; yields
    its URL once it answers, and stops it afterwards."""
    port = free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "vlm_focus.cli", "demo", "--port", str(port), *options]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the demo exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the demo did not start in {STARTUP_SECONDS} s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The demo on the embedded model."""
    model_dir = default_model_path()
    assert (model_dir / "config.json").exists(), f"the embedded model is missing at {model_dir}"
    log = tmp_path_factory.mktemp("demo") / "server.log"
    with demo_server(log) as url:
        yield url, n_visual(model_dir), log


@pytest.fixture(scope="module")
def video_server(tmp_path_factory):
    """The demo on a tiny random-weight Qwen2.5-VL saved with its real processor (a model that
    takes videos)."""
    from tiny_models import make_model
    from tiny_processors import tiny_processor

    root = tmp_path_factory.mktemp("video-demo")
    model = make_model("qwen2_5_vl")
    model.save_pretrained(root / "model")
    tiny_processor(model).save_pretrained(root / "model")
    log = root / "server.log"
    with demo_server(log, "--model", str(root / "model")) as url:
        yield url, log


def open_page(p, url: str, outside: list[str]):
    """A fresh headless Chromium on ``url``; requests beyond the demo server land in
    ``outside``."""
    browser = p.chromium.launch(
        executable_path=chromium_path(),
        headless=True,
        args=CHROMIUM_ARGS,  # launch() gives every browser a fresh temporary profile
    )
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.on(
        "request",
        lambda r: None if r.url.startswith((url, "data:", "blob:")) else outside.append(r.url),
    )
    page.goto(url)
    return browser, page


def table_row(page, index: int) -> list[str]:
    """The texts of one row of the boxes table, as the page shows them (gradio draws the rows
    as grid cells)."""
    row = page.locator(f"#boxes [role=row][data-index='{index}']")
    return [text.strip() for text in row.locator("[role=gridcell]").all_inner_texts()]


def test_browser_uploads_a_sample_and_sees_the_answer_and_maps(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    url, total, log = server
    sample = sample_scene_paths()[0]
    with Image.open(sample) as im:
        width, height = im.size
    outside = []
    with sync_playwright() as p:
        browser, page = open_page(p, url, outside)
        try:
            page.locator("#image input[type=file]").set_input_files(str(sample))
            page.locator("#prompt textarea").fill(PRESENT)
            page.locator("#run").click()
            expect(page.locator("#status")).to_contain_text("Done in", timeout=60_000)
            answer = page.locator("#answer textarea").input_value()
            stats = page.locator("#stats").inner_text()
            heat_size = page.eval_on_selector(
                "#heatmap img", "e => [e.naturalWidth, e.naturalHeight]"
            )
            kept_size = page.eval_on_selector(
                "#kept-mask img", "e => [e.naturalWidth, e.naturalHeight]"
            )
            top = table_row(page, 0)
            shot = tmp_path / "demo.png"
            page.screenshot(path=str(shot), full_page=True)
            # an absent object: "not found" in the table, no box
            page.locator("#prompt textarea").fill(QUESTION)
            page.locator("#run").click()
            # the table's label says "not found" too: wait for this request's own first row
            first_cell = page.locator("#boxes [role=row][data-index='0'] [role=gridcell]")
            expect(first_cell.first).to_have_text("red_circle", timeout=60_000)
            expect(page.locator("#status")).not_to_contain_text("processing", timeout=30_000)
            expect(page.locator("#status")).to_contain_text("Done in", timeout=30_000)
            absent_answer = page.locator("#answer textarea").input_value()
            absent = table_row(page, 0)
            # a bad request answers in the page, and the page keeps working
            page.locator("#prompt textarea").fill("   ")
            page.locator("#run").click()
            expect(page.locator("#status")).to_contain_text(
                "Could not answer. The prompt is empty: type a question or a phrase.",
                timeout=30_000,
            )
        finally:
            browser.close()
    assert answer == "yes" and absent_answer == "no", (answer, absent_answer)
    kept = re.search(r"(\d+) / (\d+) visual tokens kept", stats)
    assert kept is not None, stats
    assert (int(kept.group(1)), int(kept.group(2))) == (math.ceil(0.25 * total), total)
    assert re.search(r"prefill [\d.]+ ms unpruned -> [\d.]+ ms pruned: [\d.]+x", stats)
    assert heat_size == [width, height] and kept_size == [width, height]
    # the top box is labelled with the phrase and its centre lies on the square
    assert top[0] == "green_square", top
    x, y, w, h = (float(v) for v in top[1:5])
    sx, sy, sw, sh = SQUARE
    assert sx <= x + w / 2 <= sx + sw and sy <= y + h / 2 <= sy + sh, top
    assert float(top[6]) > 0.5, top  # its presence score
    assert absent[0] == "red_circle" and absent[6].startswith("not found"), absent
    assert not any(absent[1:6]), absent  # no box
    assert shot.stat().st_size > 20_000
    assert outside == [], f"the page reached beyond the demo server: {outside}"
    assert "Traceback" not in log.read_text()


def test_five_concurrent_requests_all_succeed(server):
    from gradio_client import Client, handle_file

    url, total, _ = server
    sample = sample_scene_paths()[0]
    client = Client(url, verbose=False)
    keeps = [0.25, 0.5, 0.75, 1.0, 0.5]

    def ask(keep: float):
        return client.predict(
            handle_file(str(sample)), QUESTION, "fastv", keep, 2, "none", False, api_name="/answer"
        )

    with ThreadPoolExecutor(max_workers=5) as pool:
        results = list(pool.map(ask, keeps))
    assert len(results) == 5
    for keep, (status, answer, unpruned, _, stats, heat, kept, _, table, fixation, *_) in zip(
        keeps, results, strict=True
    ):
        assert fixation["value"] is None  # fastv prunes in prefill: no per-step strip
        assert status.startswith("Done in"), status
        assert answer in ("yes", "no") and unpruned in ("yes", "no"), (status, answer, unpruned)
        assert f"{math.ceil(keep * total)} / {total} visual tokens kept" in stats
        with Image.open(heat) as h, Image.open(kept) as k, Image.open(sample) as s:
            assert h.size == k.size == s.size
        assert table["data"] and table["data"][0][0] == "red_circle"
        assert table["data"][0][6].startswith("not found")  # absent from the sample


def test_browser_uploads_a_video_and_sees_one_map_per_frame(video_server, tmp_path):
    from playwright.sync_api import expect, sync_playwright
    from test_demo_request import VIDEO_QUESTION, write_video

    url, log = video_server
    clip = write_video(tmp_path / "clip.webm", frames=5)  # VP8: Chromium plays it
    outside = []
    with sync_playwright() as p:
        browser, page = open_page(p, url, outside)
        try:
            page.locator("#video input[type=file]").set_input_files(str(clip))
            expect(page.locator("#video video")).to_have_count(1, timeout=30_000)
            page.locator("#prompt textarea").fill(VIDEO_QUESTION)
            page.locator("#run").click()
            expect(page.locator("#status")).to_contain_text("Done in", timeout=60_000)
            captions = page.locator("#frame-maps .caption-label")
            expect(captions).to_have_count(3, timeout=30_000)
            texts = captions.all_inner_texts()
            page.wait_for_function(  # the gallery loads its images lazily
                "() => [...document.querySelectorAll('#frame-maps img')]"
                ".every(e => e.complete && e.naturalWidth > 0)"
            )
            sizes = page.eval_on_selector_all(
                "#frame-maps img", "es => es.map(e => [e.naturalWidth, e.naturalHeight])"
            )
            stats = page.locator("#stats").inner_text()
            image_outputs_hidden = [
                page.locator(f"#{elem}").is_hidden() for elem in ("heatmap", "kept-mask", "boxes")
            ]
            toasts = page.locator(".toast-body").all_inner_texts()
            page.screenshot(path=str(tmp_path / "video.png"), full_page=True)
            # an image as well as the video: a message in the page, no answer
            page.locator("#image input[type=file]").set_input_files(str(sample_scene_paths()[0]))
            page.locator("#run").click()
            expect(page.locator("#status")).to_contain_text(
                "Could not answer. Both an image and a video were given", timeout=30_000
            )
            expect(page.locator("#frame-maps")).to_be_hidden()
        finally:
            browser.close()
    # five frames, in views of two (Qwen2.5-VL's temporal patch): 0-1, 2-3, and 4 repeated
    assert [t.rsplit(":", 1)[0] for t in texts] == [
        "frames 0-1 (0.00-0.25 s)",
        "frames 2-3 (0.50-0.75 s)",
        "frame 4 (1.00 s)",
    ], texts
    shares = [int(t.rsplit(":", 1)[1].strip().rstrip("%")) for t in texts]
    assert 98 <= sum(shares) <= 102, texts  # each share rounded to a whole percent
    assert sizes == [[48, 32]] * 3  # each frame drawn at the video's size
    assert re.search(r"(\d+) / (\d+) visual tokens kept", stats), stats
    assert image_outputs_hidden == [True, True, True]
    assert toasts == [], toasts  # no "Video not playable", no error
    assert outside == [], f"the page reached beyond the demo server: {outside}"
    assert "Traceback" not in log.read_text()


def test_the_command_lines_banner_names_its_share_flag(server):
    """The demo started from the command line says how to get a public link with ``--share``,
    not with gradio's ``share=True`` in ``launch()``."""
    _, _, log = server
    deadline = time.monotonic() + 30
    while "--share" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    text = log.read_text()
    assert "no public link (start with --share to make one)" in text, text
    assert "share=True" not in text, text


def test_browser_grounds_each_object_once_and_names_unread_words(server):
    """ "Describe the image." names no object: the table lists the objects of the answer, each
    once, and no place (the sample's answer puts two objects at `center` and two at `top`). A
    phrase the tokenizer cannot spell is named in the status."""
    from playwright.sync_api import expect, sync_playwright

    url, _, log = server
    sample = next(p for p in sample_scene_paths() if p.stem == "scene_9000006")
    outside = []
    with sync_playwright() as p:
        browser, page = open_page(p, url, outside)
        try:
            page.locator("#image input[type=file]").set_input_files(str(sample))
            page.locator("#prompt textarea").fill("Describe the image.")
            page.locator("#run").click()
            expect(page.locator("#status")).to_contain_text("Done in", timeout=60_000)
            expect(page.locator("#status")).to_contain_text("The prompt names no object")
            answer = page.locator("#answer-unpruned textarea").input_value()
            cells = page.locator("#boxes [role=row][data-index] [role=gridcell]:first-child")
            phrases = cells.all_inner_texts()
            page.locator("#prompt textarea").fill("Is there a green square in the image?")
            page.locator("#run").click()
            expect(page.locator("#status")).to_contain_text(
                "The model cannot read 'green', 'square'", timeout=60_000
            )
            status = page.locator("#status").inner_text()
        finally:
            browser.close()
    words = answer.replace(",", " ").split()
    objects = [w for w in dict.fromkeys(words) if w in CATEGORIES]  # each once, in order
    assert words.count("center") == 2 and words.count("top") == 2, answer
    assert [t.strip() for t in phrases] == objects, (phrases, answer)
    assert status.startswith("Done in"), status
    assert outside == [], f"the page reached beyond the demo server: {outside}"
    assert "Traceback" not in log.read_text()


def test_a_video_alone_through_the_api(video_server, tmp_path):
    """gradio_client asks about a video without sending an image (every input has a
    default)."""
    from gradio_client import Client, handle_file
    from test_demo_request import VIDEO_QUESTION, write_video

    url, log = video_server
    clip = write_video(tmp_path / "clip.mp4", frames=4)
    client = Client(url, verbose=False)
    status, answer, *_, frames = client.predict(
        video_value=handle_file(str(clip)),
        prompt_value=VIDEO_QUESTION,
        api_name="/answer",
    )
    assert status.startswith("Done in"), status
    captions = [item["caption"].rsplit(":", 1)[0] for item in frames["value"]]
    assert captions == ["frames 0-1 (0.00-0.25 s)", "frames 2-3 (0.50-0.75 s)"]
    assert "Traceback" not in log.read_text()
