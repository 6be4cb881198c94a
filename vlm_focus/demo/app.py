"""``vlm-focus demo``: a Gradio page over :func:`vlm_focus.demo.request.run_request`.

The model loads once at startup (the embedded organism model by default, safetensors only, no
repository code unless ``--trust-remote-code``). The page binds to 127.0.0.1 unless ``--host``
says otherwise, shares nothing unless ``--share``, sends no analytics and loads no web fonts.
Requests go through gradio's queue: ``--concurrency`` at a time, at most ``--queue-size`` waiting.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


from ..core.options import add_options, parse_config  # noqa: E402
from ..loading import LoadOptions  # noqa: E402
from .inputs import MITIGATIONS  # noqa: E402
from .request import run_request  # noqa: E402
from .result import DemoResult  # noqa: E402
from .served import Served, sample_scenes  # noqa: E402

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
MAX_FILE_SIZE = 64 * 1024 * 1024  # bytes per upload
#: Small images (the organism's scenes are 192 px) are drawn at the panel size, cells kept sharp.
CSS = """
#image img, #heatmap img, #kept-mask img, #objects img, #frame-maps img {
  width: 100%; height: 100%; object-fit: contain; image-rendering: pixelated;
}
"""
LOCAL_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]
LOCAL_MONO = ["ui-monospace", "Consolas", "monospace"]


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


def _picture(label: str, elem_id: str, *, height: int | None = 320, visible: bool = True) -> Any:
    """An output image of the page (PNG, drawn at the panel's size)."""
    import gradio as gr

    return gr.Image(
        label=label,
        format="png",
        interactive=False,
        elem_id=elem_id,
        height=height,
        visible=visible,
    )


def _with_signature(parameters: list[tuple[str, Any]]) -> Callable[[Callable], Callable]:
    """A function of ``**values`` called with the named parameters ``(name, default)``, in
    order, that gradio lists as its API's inputs: every one has a default, so a call may leave
    any out (the image, for a video)."""
    signature = inspect.Signature(
        [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
            for name, default in parameters
        ]
    )

    def named(fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return fn(**bound.arguments)

        call.__signature__ = signature
        return call

    return named


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

    from .widgets import model_updates, more_widgets, page_widgets

    served = served or Served(model, processor)
    samples = sample_scenes()
    n_layers = served.n_layers

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
                # the pruning options: FocusConfig's, each at its default (widgets.py)
                focus = page_widgets(n_layers)
                mitigation = gr.Dropdown(
                    choices=list(MITIGATIONS),
                    value="none",
                    label="Mitigation",
                    elem_id="mitigation",
                )
                pruner_options = gr.Textbox(
                    value="",
                    label="Pruner options (NAME=VALUE, comma-separated; `vlm-focus pruners` "
                    "lists each pruner's)",
                    placeholder="e.g. base=text for debiased, alpha=0.3 for pyramid",
                    elem_id="pruner-options",
                )
                zoom = gr.Checkbox(value=False, label="Look closer (zoom)", elem_id="zoom")
                with gr.Accordion("More pruning options", open=False):
                    more = more_widgets()
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
                    heat = _picture("Attention to the prompt phrase, with boxes", "heatmap")
                    kept = _picture("Visual tokens kept (pruned patches darkened)", "kept-mask")
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
                fixation = _picture(
                    "Where each decoding step looked (fixation: the visual tokens that step "
                    "attended to; the token it wrote underneath)",
                    "fixation",
                    height=None,
                    visible=False,
                )
                table = gr.Dataframe(
                    headers=["phrase", "x", "y", "w", "h", "region score", "presence"],
                    label="Boxes (pixels), region scores and presence (not found: no box)",
                    interactive=False,
                    elem_id="boxes",
                )
                zoomed = gr.Textbox(label="Answer (zoomed)", elem_id="answer-zoomed", visible=False)
                zoom_map = _picture(
                    "Look closer: the crop on the prompt's attention", "zoom-map", visible=False
                )

        def pick(choice: str | None):
            return samples.get(choice) if choice else gr.skip()

        # /answer's inputs, in the order of its first API (old calls still fit): the image,
        # the prompt, the page's pruning options, the mitigation, the zoom, the pruner's own
        # options, the video, then the other pruning options
        inputs = {
            "image": image,
            "prompt": prompt,
            **focus,
            "mit": mitigation,
            "zoom": zoom,
            "options": pruner_options,
            "video": video,
            **more,
        }
        focus_names = [*focus, *more]

        @_with_signature([(f"{name}_value", c.value) for name, c in inputs.items()])
        def respond(**values):
            given = {name: values[f"{name}_value"] for name in inputs}
            model_now, processor_now = served.pair
            result = run_request(
                model_now,
                processor_now,
                given["image"],
                given["prompt"],
                mitigation=given["mit"],
                max_new_tokens=max_new_tokens,
                repeats=repeats,
                video=given["video"],
                zoom=bool(given["zoom"]),
                pruner_options=given["options"] or "",
                **{name: given[name] for name in focus_names},
            )
            if not result.ok:
                gr.Warning(result.message)
            values = list(outputs_of(result))
            values[7] = gr.update(value=values[7], visible=bool(values[7]))  # object maps
            values[9] = gr.update(value=values[9], visible=values[9] is not None)  # fixation
            shown = bool(given["zoom"]) and result.ok
            values[10] = gr.update(value=values[10], visible=shown)  # zoomed answer
            values[11] = gr.update(value=values[11], visible=shown)  # zoom overlay
            values[12] = gr.update(value=values[12], visible=bool(values[12]))  # frame maps
            return tuple(values)

        def image_outputs(video_value):
            # a video's maps are per frame: the image's map, kept mask and boxes step aside
            return [gr.update(visible=video_value is None)] * 3

        refitted = list(model_updates(n_layers))  # the widgets that follow the model

        def switch(path: str):
            ok, message = served.load(path)
            if not ok:
                gr.Warning(message)
                return message, gr.skip(), *[gr.skip()] * len(refitted)
            updates = model_updates(served.n_layers)
            return message, _header(served.name), *[updates[name] for name in refitted]

        load.click(
            switch,
            inputs=[model_path],
            outputs=[model_status, header, *[focus[name] for name in refitted]],
            api_name=False,
        )
        sample.change(pick, inputs=[sample], outputs=[image], api_name=False)
        video.change(image_outputs, inputs=[video], outputs=[heat, kept, table], api_name=False)
        run.click(
            respond,
            inputs=list(inputs.values()),
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
