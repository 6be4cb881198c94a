"""``vlm-focus run`` and ``bench`` on Qwen-VL checkpoints saved with their real processors: a
video file decoded by OpenCV, and an image on Qwen3-VL."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import make_model  # noqa: E402
from tiny_processors import noise_image, noise_video, tiny_processor  # noqa: E402

from vlm_focus import cli  # noqa: E402
from vlm_focus.loading import build_video_inputs, load_video  # noqa: E402

FRAMES, HEIGHT, WIDTH, FPS = 8, 32, 48, 4.0


def _checkpoint(kind: str, path: Path) -> Path:
    model = make_model(kind)
    model.save_pretrained(path)
    tiny_processor(model).save_pretrained(path)
    return path


def _mp4(path: Path) -> Path:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), FPS, (WIDTH, HEIGHT))
    for frame in noise_video(FRAMES, WIDTH, HEIGHT, seed=3):
        writer.write(np.ascontiguousarray(frame[..., ::-1]))  # OpenCV writes BGR
    writer.release()
    return path


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_run_answers_about_a_video_pruned_and_unpruned(kind, tmp_path, capsys):
    model = _checkpoint(kind, tmp_path / "model")
    video = _mp4(tmp_path / "clip.mp4")
    argv = ["run", "--model", str(model), "--video", str(video), "--frames", "4"]
    argv += ["--prompt", "what moves", "--keep", "0.5", "--budget", "frame"]
    assert cli.main([*argv, "--repeats", "1", "--max-new-tokens", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["video"] == str(video) and report["model"] == kind
    frames, metadata = load_video(video, 4)
    assert metadata["frames_indices"] == [0, 2, 5, 7] and frames.shape == (4, HEIGHT, WIDTH, 3)
    processor = AutoProcessor.from_pretrained(model)
    grid = build_video_inputs(processor, frames, metadata, "what moves")["video_grid_thw"]
    tokens = int(grid.prod()) // 4  # merged 2 x 2
    assert report["visual_total"] == tokens and report["visual_kept"] == tokens // 2
    assert report["budget"] == "frame" and report["pruned"]
    # the video default at layer 2: diverse, named beside the setting
    assert (report["pruner"], report["video_pruner"], report["pruned_by"]) == (
        "fastv",
        "auto",
        "diverse",
    )


def test_bench_runs_on_qwen3_vl(tmp_path, capsys):
    model = _checkpoint("qwen3_vl", tmp_path / "model")
    noise_image(48, 32, seed=1).save(tmp_path / "image.png")
    argv = ["bench", "--model", str(model), "--image", str(tmp_path / "image.png")]
    assert cli.main([*argv, "--keeps", "1.0,0.5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "keep=1.0" in out and "keep=0.5" in out


def test_bad_video_input_names_the_problem(tmp_path, capsys):
    model = _checkpoint("qwen2_5_vl", tmp_path / "model")
    base = ["run", "--model", str(model)]
    (tmp_path / "not_a_video.mp4").write_bytes(b"nothing here")
    cases = [
        (["--video", str(tmp_path / "missing.mp4")], "video file not found"),
        (["--video", str(tmp_path / "not_a_video.mp4")], "is not a readable video"),
        (["--video", "x.mp4", "--image", "y.png"], "--image or --video, not both"),
        (["--video", "x.mp4", "--frames", "0"], "frames=0"),
    ]
    for extra, message in cases:
        assert cli.main([*base, *extra]) == 2
        assert message in capsys.readouterr().err, extra


def test_run_and_bench_say_how_many_frames_a_short_video_gave(tmp_path, capsys):
    model = _checkpoint("qwen2_5_vl", tmp_path / "model")
    video = _mp4(tmp_path / "clip.mp4")  # FRAMES = 8
    argv = ["--model", str(model), "--video", str(video), "--frames", "64", "--repeats", "1"]
    said = f"warning   --frames 64 asked, but the video has {FRAMES} frames: all {FRAMES} used"
    assert cli.main(["run", *argv, "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert f"video {video} ({FRAMES} frames)" in out and said in out
    assert cli.main(["run", *argv, "--max-new-tokens", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["frames"], report["frames_asked"]) == (FRAMES, 64)
    assert cli.main(["bench", *argv, "--keeps", "0.5"]) == 0
    assert said.replace("warning   ", "warning: ") in capsys.readouterr().out
    assert cli.main(["run", *argv[:-4], "--frames", "4", "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["frames"] == 4
