"""``vlm-focus demo``: a Gradio page over :func:`vlm_focus.demo.request.run_request`.

The model loads once at startup (the embedded organism model by default, safetensors only, no
repository code unless ``--trust-remote-code``). The page binds to 127.0.0.1 unless ``--host``
says otherwise, shares nothing unless ``--share``, sends no analytics and loads no web fonts.
Requests go through gradio's queue: ``--concurrency`` at a time, at most ``--queue-size`` waiting.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import numpy as np  # noqa: E402

from ..config import FocusConfig, LoadOptions  # noqa: E402
from ..core.options import add_options, default_of, parse_config  # noqa: E402
from .inputs import MITIGATIONS  # noqa: E402
from .request import MODEL_LOCK, run_request  # noqa: E402
from .result import DemoResult  # noqa: E402

DESCRIPTION = (
    "Gradio page: ask about an image or a short video, see the answer pruned and unpruned, "
    "attention maps with boxes and region scores (one map per frame of a video), the visual "
    "tokens kept and the prefill speed-up."
)
DEFAULT_QUESTION = "Is there a red_circle in the image?"
EXAMPLE_PROMPTS = (
    "Is there a red_circle in the image?",
    "Describe the image.",
    "Is there a blue_square in the image?",
)
# the page's pruning defaults are vf.wrap's (FocusConfig's), like every command line's
DEFAULT_PRUNER = default_of(FocusConfig, "pruner")
DEFAULT_KEEP = default_of(FocusConfig, "keep")
DEFAULT_LAYER = default_of(FocusConfig, "layer")
N_SAMPLES = 6
MAX_FILE_SIZE = 64 * 1024 * 1024  # bytes per upload
#: Small images (the organism's scenes are 192 px) are drawn at the panel size, cells kept sharp.
CSS = """
#image img, #heatmap img, #kept-mask img, #objects img, #frame-maps img {
  width: 100%; height: 100%; object-fit: contain; image-rendering: pixelated;
}
"""
LOCAL_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]
LOCAL_MONO = ["ui-monospace", "Consolas", "monospace"]


def sample_scenes(n: int = N_SAMPLES) -> dict[str, np.ndarray]:
    """Name -> RGB image of the bundled sample scenes (rendered held-out scenes when the package
    ships none)."""
    from PIL import Image

    from ..asset_paths import sample_scene_paths

    out: dict[str, np.ndarray] = {}
    for path in sample_scene_paths()[:n]:
        with Image.open(path) as opened:
            out[path.stem] = np.asarray(opened.convert("RGB"))
    if not out:
        from ..eval.scenes import heldout_scenes

        for scene in heldout_scenes(n):
            out[f"scene-{scene.seed}"] = scene.image()
    return out


def _n_layers(model: Any) -> int:
    from ..model_adapters import get_adapter

    try:
        return len(get_adapter(model).decoder_layers(model))
    except ValueError:
        return 1


class Served:
    """The model the page serves. :meth:`load` swaps it for another (safetensors only; repository
    code only when the app was started with ``--trust-remote-code``)."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        device: str = "cpu",
        attn: str = "sdpa",
        trust_remote_code: bool = False,
    ) -> None:
        self.pair = (model, processor)  # replaced as one, read as one
        self.device, self.attn, self.trust_remote_code = device, attn, trust_remote_code

    @property
    def model(self) -> Any:
        return self.pair[0]

    @property
    def processor(self) -> Any:
        return self.pair[1]

    @property
    def name(self) -> str:
        """The model's hub id or folder; the embedded models by their own name."""
        from pathlib import Path

        from ..asset_paths import default_model_path, guide_model_path

        config = getattr(self.model, "config", None)
        name = getattr(config, "_name_or_path", "") or type(self.model).__name__
        for embedded in (default_model_path(), guide_model_path()):
            if Path(name).resolve() == embedded.resolve():
                return f"{embedded.name} (embedded)"
        return name

    @property
    def n_layers(self) -> int:
        return _n_layers(self.model)

    def load(self, path: str) -> tuple[bool, str]:
        """Load ``path`` (a local folder or hub id) and serve it; on failure keep the current
        model. Returns ``(ok, message for the user)``."""
        from ..loading import load_model

        path = (path or "").strip()
        if not path:
            return False, "Type a model folder or hub id to load."
        try:
            model, processor = load_model(
                path,
                device=self.device,
                attn_implementation=self.attn,
                trust_remote_code=self.trust_remote_code,
            )
        except Exception as err:  # a bad folder must not take the page down
            return False, f"The model could not be loaded; still serving `{self.name}`. {err}"
        with MODEL_LOCK:  # no request runs while the model changes
            self.pair = (model, processor)
        return True, f"Now serving `{self.name}` ({model.config.model_type})."


def _let_unreadable_files_through(component: Any) -> None:
    """Make an image input hand files it cannot read to the request function, which answers
    them with a clear message (gradio's own check only says "Error"). Patches the instance."""
    strict = component.preprocess

    def preprocess(payload: Any) -> Any:
        try:
            return strict(payload)
        except Exception:
            return None if payload is None else getattr(payload, "path", None)

    component.preprocess = preprocess


def outputs_of(result: DemoResult) -> tuple:
    """The page's output values for one result (same order as the output components)."""
    if not result.ok:
        status = f"**Could not answer.** {result.message}"
        return (status, "", "", "", "", None, None, [], [], None, "", None, [])
    notes = " ".join(result.notices)
    status = f"Done in {result.seconds:.1f} s." + (f" {notes}" if notes else "")
    stats = f"**{result.kept_text}**  \n{result.timing_text}"
    gallery = [(m.overlay, m.caption) for m in result.object_maps]
    mitigated = result.answer_mitigated if result.mitigation != "none" else ""
    return (
        status,
        result.answer,
        result.answer_unpruned,
        mitigated,
        stats,
        result.heatmap,
        result.kept_overlay,
        gallery,
        result.box_rows(),
        result.fixation_strip,
        result.answer_zoomed,
        result.zoom_overlay,
        [(m.overlay, m.caption) for m in result.frame_maps],
    )


def _header(name: str) -> str:
    return (
        "## vlm_focus: where the model looks, and what pruning keeps\n"
        f"Model: `{name}`. Ask about an image: the page shows the answer with and without "
        "visual-token pruning, the attention map of your phrase and of each object the "
        "answer names (with boxes and their region scores), the visual tokens the pruner "
        "kept, and the prefill time pruned against unpruned, measured in the same request. "
        "A model that takes videos also answers about a short video, with your phrase's "
        "attention map in each frame."
    )


def build_app(
    model: Any,
    processor: Any,
    *,
    max_new_tokens: int = 24,
    repeats: int = 5,
    served: Served | None = None,
    model_panel: bool = True,
):
    """The demo page (``gr.Blocks``) serving ``model``; call ``.queue(...).launch(...)`` on it.

    ``served`` (default: built from ``model`` and ``processor``) holds the model and its loading
    options for the page's "Model" panel (hidden with ``model_panel=False``)."""
    import gradio as gr

    import vlm_focus as vf

    served = served or Served(model, processor)
    samples = sample_scenes()
    n_layers = served.n_layers
    default_layer = min(DEFAULT_LAYER, n_layers - 1)

    with gr.Blocks(analytics_enabled=False, title="vlm_focus demo") as demo:
        header = gr.Markdown(_header(served.name))
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(
                    type="filepath",
                    image_mode=None,
                    format="png",
                    sources=["upload", "clipboard"],
                    label="Image",
                    elem_id="image",
                    height=320,
                )
                _let_unreadable_files_through(image)
                sample = gr.Dropdown(
                    choices=list(samples),
                    value=None,
                    label="...or a sample scene",
                    elem_id="sample",
                )
                video = gr.Video(
                    sources=["upload"],
                    label="...or a short video (for a model that takes videos)",
                    elem_id="video",
                    height=240,
                )
                prompt = gr.Textbox(
                    value=DEFAULT_QUESTION, label="Question or phrase", elem_id="prompt"
                )
                gr.Examples([[p] for p in EXAMPLE_PROMPTS], inputs=[prompt], label="Prompts")
                with gr.Row():
                    pruner = gr.Dropdown(choices=vf.pruners(), value=DEFAULT_PRUNER, label="Pruner")
                    mitigation = gr.Dropdown(
                        choices=list(MITIGATIONS), value="none", label="Mitigation"
                    )
                keep = gr.Slider(0.05, 1.0, value=DEFAULT_KEEP, step=0.05, label="Keep ratio")
                layer = gr.Slider(
                    0, max(n_layers - 1, 0), value=default_layer, step=1, label="Prune at layer"
                )
                pruner_options = gr.Textbox(
                    value="",
                    label="Pruner options (NAME=VALUE, comma-separated; `vlm-focus pruners` "
                    "lists each pruner's)",
                    placeholder="e.g. base=text for debiased, alpha=0.3 for pyramid",
                    elem_id="pruner-options",
                )
                zoom = gr.Checkbox(value=False, label="Look closer (zoom)", elem_id="zoom")
                run = gr.Button("Run", variant="primary", elem_id="run")
                with gr.Accordion("Model", open=False, visible=model_panel):
                    model_path = gr.Textbox(
                        label="Model folder or hub id (safetensors weights)",
                        placeholder="e.g. llava-hf/llava-1.5-7b-hf",
                        elem_id="model-path",
                    )
                    load = gr.Button("Load model", elem_id="load-model")
                    model_status = gr.Markdown(elem_id="model-status")
            with gr.Column(scale=2):
                status = gr.Markdown(elem_id="status")
                answer = gr.Textbox(label="Answer (pruned)", elem_id="answer")
                with gr.Row():
                    unpruned = gr.Textbox(label="Answer (unpruned)", elem_id="answer-unpruned")
                    mitigated = gr.Textbox(
                        label="Answer (pruned, with the mitigation)", elem_id="answer-mitigated"
                    )
                stats = gr.Markdown(elem_id="stats")
                with gr.Row():
                    heat = gr.Image(
                        label="Attention to the prompt phrase, with boxes",
                        format="png",
                        interactive=False,
                        elem_id="heatmap",
                        height=320,
                    )
                    kept = gr.Image(
                        label="Visual tokens kept (pruned patches darkened)",
                        format="png",
                        interactive=False,
                        elem_id="kept-mask",
                        height=320,
                    )
                objects = gr.Gallery(
                    label="Attention to each object word of the answer",
                    columns=4,
                    height=220,
                    format="png",
                    elem_id="objects",
                    visible=False,
                )
                frames = gr.Gallery(
                    label="Attention to the prompt phrase in each video frame (one colour "
                    "scale; each caption: the frames, their time, the share of the attention)",
                    columns=4,
                    height=260,
                    format="png",
                    elem_id="frame-maps",
                    visible=False,
                )
                fixation = gr.Image(
                    label="Where each decoding step looked (fixation: the visual tokens that "
                    "step attended to; the token it wrote underneath)",
                    format="png",
                    interactive=False,
                    elem_id="fixation",
                    visible=False,
                )
                table = gr.Dataframe(
                    headers=["phrase", "x", "y", "w", "h", "region score", "presence"],
                    label="Boxes (pixels), region scores and presence (not found: no box)",
                    interactive=False,
                    elem_id="boxes",
                )
                zoomed = gr.Textbox(label="Answer (zoomed)", elem_id="answer-zoomed", visible=False)
                zoom_map = gr.Image(
                    label="Look closer: the crop on the prompt's attention",
                    format="png",
                    interactive=False,
                    elem_id="zoom-map",
                    height=320,
                    visible=False,
                )

        def pick(choice: str | None):
            return samples.get(choice) if choice else gr.skip()

        # every input has a default, so an API call may leave any out: the image for a video
        # (gradio marks a parameter optional when its default is None or its component's value)
        def respond(
            image_value=None,
            prompt_value=DEFAULT_QUESTION,
            pruner_value=DEFAULT_PRUNER,
            keep_value=DEFAULT_KEEP,
            layer_value=default_layer,
            mit_value="none",
            zoom_value=False,
            options_value="",
            video_value=None,
        ):
            model_now, processor_now = served.pair
            result = run_request(
                model_now,
                processor_now,
                image_value,
                prompt_value,
                pruner_value,
                keep_value,
                layer_value,
                mit_value,
                max_new_tokens=max_new_tokens,
                repeats=repeats,
                video=video_value,
                zoom=bool(zoom_value),
                pruner_options=options_value or "",
            )
            if not result.ok:
                gr.Warning(result.message)
            values = list(outputs_of(result))
            values[7] = gr.update(value=values[7], visible=bool(values[7]))  # object maps
            values[9] = gr.update(value=values[9], visible=values[9] is not None)  # fixation
            shown = bool(zoom_value) and result.ok
            values[10] = gr.update(value=values[10], visible=shown)  # zoomed answer
            values[11] = gr.update(value=values[11], visible=shown)  # zoom overlay
            values[12] = gr.update(value=values[12], visible=bool(values[12]))  # frame maps
            return tuple(values)

        def image_outputs(video_value):
            # a video's maps are per frame: the image's map, kept mask and boxes step aside
            return [gr.update(visible=video_value is None)] * 3

        def switch(path: str):
            ok, message = served.load(path)
            if not ok:
                gr.Warning(message)
                return message, gr.skip(), gr.skip()
            n = served.n_layers
            slider = gr.update(maximum=max(n - 1, 0), value=min(DEFAULT_LAYER, n - 1))
            return message, _header(served.name), slider

        load.click(
            switch, inputs=[model_path], outputs=[model_status, header, layer], api_name=False
        )
        sample.change(pick, inputs=[sample], outputs=[image], api_name=False)
        video.change(image_outputs, inputs=[video], outputs=[heat, kept, table], api_name=False)
        run.click(
            respond,
            inputs=[image, prompt, pruner, keep, layer, mitigation, zoom, pruner_options, video],
            outputs=[
                status,
                answer,
                unpruned,
                mitigated,
                stats,
                heat,
                kept,
                objects,
                table,
                fixation,
                zoomed,
                zoom_map,
                frames,
            ],
            api_name="answer",
        )
    return demo


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlm-focus demo", description=DESCRIPTION)
    # --model --device --attn --trust-remote-code, defined (and defaulted) as in every command
    add_options(p, LoadOptions, defaults=True)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="open a public gradio share link")
    p.add_argument(
        "--lock-model", action="store_true", help="hide the page's panel that loads other models"
    )
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=2, help="requests served at once")
    p.add_argument("--queue-size", type=int, default=16, help="requests allowed to wait")
    return p


def _banner(args: argparse.Namespace) -> str:
    """What the command line prints on start: the address, and how to get a public link in
    its own words (``--share``; gradio's own banner names ``launch(share=True)``, which is
    right for a script calling :func:`build_app`, not for ``vlm-focus demo``)."""
    where = f"vlm-focus demo: serving on http://{args.host}:{args.port}"
    if args.share:
        return f"{where}; a public gradio link follows (--share)"
    return f"{where}; no public link (start with --share to make one)"


def launch(demo: Any, args: argparse.Namespace, *, block: bool = True):
    """Queue and launch ``demo`` with the command line's network options, printing
    :func:`_banner` instead of gradio's own start-up lines."""
    import gradio as gr

    theme = gr.themes.Default(font=LOCAL_FONTS, font_mono=LOCAL_MONO)
    demo.queue(default_concurrency_limit=args.concurrency, max_size=args.queue_size)
    print(_banner(args), flush=True)
    return demo.launch(
        server_name=args.host,
        server_port=args.port,
        share=args.share,
        inbrowser=False,
        prevent_thread_lock=not block,
        max_file_size=MAX_FILE_SIZE,
        ssr_mode=False,
        footer_links=[],
        theme=theme,
        css=CSS,
        quiet=True,  # gradio's banner speaks of launch(share=True); _banner() of --share
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    load_options = parse_config(LoadOptions, args)
    args.model, args.attn = load_options.model, load_options.attn
    args.trust_remote_code = load_options.trust_remote_code
    from ..loading import resolve_device

    args.device = resolve_device(load_options.device)
    for name in ("concurrency", "queue_size"):
        if getattr(args, name) < 1:
            print(f"vlm-focus demo: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    from ..loading import load_model

    try:
        model, processor = load_model(
            args.model,
            device=args.device,
            attn_implementation=args.attn,
            trust_remote_code=args.trust_remote_code,
        )
    except (ValueError, OSError) as err:
        print(f"vlm-focus demo: cannot load the model: {err}", file=sys.stderr)
        return 2
    served = Served(
        model,
        processor,
        device=args.device,
        attn=args.attn,
        trust_remote_code=args.trust_remote_code,
    )
    demo = build_app(
        model,
        processor,
        max_new_tokens=args.max_new_tokens,
        served=served,
        model_panel=not args.lock_model,
    )
    launch(demo, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
