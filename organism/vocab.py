"""Vocabulary, tokenizer, processor and model configs of the organism VLMs, both architectures.

The tokenizer is a word-level `tokenizers` model built from the scene vocabulary: every category
(`red_circle`) and every coarse position (`top_left`) is one token. The LLaVA-shaped organisms
use a stock `LlavaProcessor` (CLIP image geometry) and `LlavaConfig` of a :class:`OrganismSpec`;
organism-qwen extends the same vocabulary with Qwen's ChatML and vision markers and the video
questions' words (:data:`QWEN_VOCAB`) and uses a stock `Qwen2_5_VLProcessor` and
`Qwen2_5_VLConfig` of a :class:`QwenSpec`; organism-qwen35 adds the words of Qwen3.5's frame
timestamps (:data:`QWEN35_VOCAB`). Every processor loads offline with
`vlm_focus.loading.load_processor(path)`; plain `AutoProcessor.from_pretrained(path)` serves all
but organism-qwen35, whose model type transformers ties to its byte-level BPE tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vlm_focus.asset_paths import CAPTION_PROMPT as CAPTION_PROMPT  # the organisms' caption prompt

from .clips import CLIP_SIZE, FRAMES, TEMPORAL
from .scenes import CATEGORIES, COLOURS, IMAGE_SIZE, POSITIONS, RELATIONS, SHAPES

SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>", "<image>")
WORDS = (
    "user", ":", "assistant", "is", "there", "a", "an", "in", "the", "image", "?", ".", ",", "yes",
    "no", "of", "describe", "answer", "question", "using", "single", "word", "or", "phrase",
)  # fmt: skip
# appended last, so the ids of every earlier word stay stable (the two-hop family's words
# come after `where`; models trained before them never see these ids)
LATER_WORDS = ("where", "what", "colour", "shape", "object", *COLOURS, *SHAPES)
VOCAB: tuple[str, ...] = SPECIAL + WORDS + RELATIONS + CATEGORIES + POSITIONS + LATER_WORDS
TOKEN_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
PAD, BOS, EOS, UNK, IMAGE = (TOKEN_ID[t] for t in SPECIAL)
YES, NO = TOKEN_ID["yes"], TOKEN_ID["no"]

POPE_SUFFIX = "\nAnswer the question using a single word or phrase."

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %} ASSISTANT:"
    "{% else %} {% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{{ item['text'] }}{% endfor %}{% endif %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def presence_question(category: str) -> str:
    """The POPE question for `category` (`vlm_focus.eval.pope.question_text`)."""
    from vlm_focus.eval.pope import question_text

    return question_text(category)


def where_question(category: str) -> str:
    return f"Where is the {category}?"


def relation_question(a: str, relation: str, b: str) -> str:
    return f"Is the {a} {_relation_phrase(relation)} the {b}?"


def _relation_phrase(relation: str) -> str:
    return f"{relation} of" if relation in ("left", "right") else relation


def two_hop_question(form: str, relation: str, anchor: str, asked: str = "") -> str:
    """A two-hop question about the object {relation} the `anchor` (never named itself):

    - `colour`: "What colour is the shape left of the red_circle?" (answer: a colour word);
    - `category`: "What is right of the green_cross?" (answer: a category token);
    - `shape`: "Is the object below the blue_square a triangle?" (yes/no about `asked`);
    - `is_category`: "Is the object above the red_circle a blue_square?" (yes/no, POPE-style).
    """
    rel = _relation_phrase(relation)
    if form == "colour":
        return f"What colour is the shape {rel} the {anchor}?"
    if form == "category":
        return f"What is {rel} the {anchor}?"
    if form in ("shape", "is_category"):
        article = "an" if asked[:1] in "aeiou" else "a"
        return f"Is the object {rel} the {anchor} {article} {asked}?"
    raise ValueError(f"form={form!r}; allowed: {TWO_HOP_FORMS}")


TWO_HOP_FORMS = ("colour", "category", "shape", "is_category")


def words(text: str) -> list[str]:
    """Split text the way the tokenizer does (lower case; punctuation split off words)."""
    import re

    return re.findall(r"\w+|[^\w\s]+", text.lower())


def encode(text: str) -> list[int]:
    """Token ids of plain text (no special tokens), identical to the saved tokenizer's."""
    return [TOKEN_ID.get(w, UNK) for w in words(text)]


def build_tokenizer():
    """A `PreTrainedTokenizerFast` over VOCAB: word level, lower-cased, chat template attached."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(dict(TOKEN_ID), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass(frozen=True)
class OrganismSpec:
    """Size of one organism model. `patch` sets the visual grid: (IMAGE_SIZE / patch)^2 tokens."""

    name: str
    patch: int = 16
    vision_hidden: int = 192
    vision_layers: int = 4
    vision_heads: int = 4
    text_hidden: int = 128
    text_layers: int = 4
    text_heads: int = 4
    text_mlp: int = 512

    @property
    def grid(self) -> int:
        return IMAGE_SIZE // self.patch

    @property
    def n_visual(self) -> int:
        return self.grid * self.grid


_GUIDE = OrganismSpec(
    "organism-guide",
    patch=32,
    vision_hidden=128,
    vision_layers=3,
    vision_heads=4,
    text_hidden=160,
    text_layers=3,
    text_heads=5,
    text_mlp=640,
)
SPECS: dict[str, OrganismSpec] = {
    "default": OrganismSpec("organism-default", text_hidden=256, text_heads=8, text_mlp=1024),
    "guide": _GUIDE,
    # a deeper, narrower LM: eight layers, so that the two-hop read can sit after layer 2
    "deep": OrganismSpec(
        "organism-deep", text_hidden=160, text_layers=8, text_heads=5, text_mlp=576
    ),
    # a guide for the deep model: organism-guide's tower (6 x 6 tokens) and a 4-layer LM, deep
    # enough for the two-hop read (layers 2-3)
    "twohop-guide": replace(_GUIDE, name="organism-twohop-guide", text_layers=4, text_mlp=480),
    "tiny": OrganismSpec(
        "organism-tiny",
        patch=48,
        vision_hidden=32,
        vision_layers=1,
        vision_heads=2,
        text_hidden=32,
        text_layers=2,
        text_heads=4,  # the auxiliary losses supervise heads 0-2
        text_mlp=64,
    ),
}


def build_config(spec: OrganismSpec):
    """`LlavaConfig` of a CLIP tower + Llama LM of the given size over VOCAB."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=IMAGE_SIZE,
        patch_size=spec.patch,
        projection_dim=spec.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_heads,
        max_position_embeddings=512,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=spec.n_visual,
        tie_word_embeddings=False,
    )


def build_processor(spec: OrganismSpec):
    """`LlavaProcessor` with CLIP geometry at IMAGE_SIZE and the word-level tokenizer."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=build_tokenizer(),
        patch_size=spec.patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=CHAT_TEMPLATE,
    )


# ---- organism-qwen: Qwen2.5-VL over the same words ------------------------------------------


TOKEN = 28  # pixels per side of one merged token (patch 14, merge 2)
QWEN_SPECIAL = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VIDEO_WORDS = ("which", "appears", "first", "at", "end", "start", "video", "system")
QWEN_VOCAB: tuple[str, ...] = VOCAB + QWEN_SPECIAL + VIDEO_WORDS + ("\n",)
QWEN_ID: dict[str, int] = {w: i for i, w in enumerate(QWEN_VOCAB)}
# Qwen3.5's processor writes `<0.2 seconds>` before each temporal patch of a clip; its words,
# with digits split one by one, extend organism-qwen35's vocabulary alone (appended, so every
# id of QWEN_VOCAB stays as it is)
TIMESTAMP_WORDS = ("<", ">", "seconds", *"0123456789")
QWEN35_VOCAB: tuple[str, ...] = QWEN_VOCAB + TIMESTAMP_WORDS
IM_END, IMAGE_PAD, VIDEO_PAD = (
    QWEN_ID["<|im_end|>"],
    QWEN_ID["<|image_pad|>"],
    QWEN_ID["<|video_pad|>"],
)
VISION_START, VISION_END = QWEN_ID["<|vision_start|>"], QWEN_ID["<|vision_end|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    f"{{% if item['type'] == 'image' %}}{IMAGE_PLACEHOLDER}"
    f"{{% elif item['type'] == 'video' %}}{VIDEO_PLACEHOLDER}"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen_tokenizer(vocab: tuple[str, ...] = QWEN_VOCAB):
    """Word-level, lower-cased tokenizer over `vocab` (:data:`QWEN_VOCAB` or
    :data:`QWEN35_VOCAB`); ``<|im_end|>`` ends a turn. A vocabulary with digits reads numbers
    digit by digit, so that any timestamp is in its words."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if "0" in vocab:
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
        )
    specials = ("<pad>", "<bos>", "<eos>", "<unk>", *QWEN_SPECIAL)
    core.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    core.add_tokens([AddedToken("\n", normalized=False)])  # whitespace the pre-tokenizer keeps
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_qwen_processor():
    """The stock ``Qwen2_5_VLProcessor``: Qwen2-VL's image and video processors (patch 14,
    merge 2, temporal patch 2, CLIP normalisation) with pixel budgets that keep every organism
    image and frame at its own size, the word tokenizer and a ChatML template."""
    import transformers

    geometry = dict(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=TEMPORAL,
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )
    image_processor = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": 4 * TOKEN * TOKEN, "longest_edge": 280 * 280}, **geometry
    )
    video_processor = transformers.Qwen2VLVideoProcessor(
        size={"shortest_edge": 4 * TOKEN * TOKEN, "longest_edge": CLIP_SIZE * CLIP_SIZE * FRAMES},
        do_sample_frames=False,
        cap_pixels_per_frame=True,  # the reference implementation's budget (qwen-vl-utils)
        **geometry,
    )
    return transformers.Qwen2_5_VLProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=build_qwen_tokenizer(),
        chat_template=QWEN_TEMPLATE,
    )


@dataclass(frozen=True)
class QwenSpec:
    """Size of organism-qwen; ``text_mrope`` splits the rotary half of a head (t, h, w)."""

    vision_hidden: int = 64
    vision_layers: int = 3
    vision_heads: int = 4
    vision_mlp: int = 192
    text_hidden: int = 128
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    text_mlp: int = 320
    text_mrope: tuple[int, int, int] = (4, 6, 6)


def build_qwen_config(spec: QwenSpec = QwenSpec()):
    """``Qwen2_5_VLConfig`` of the given size over :data:`QWEN_VOCAB` (tied embeddings;
    the tower's last block attends globally, the others in 112 px windows, as Qwen2.5-VL's)."""
    from transformers import Qwen2_5_VLConfig

    vision = dict(
        depth=spec.vision_layers,
        hidden_size=spec.vision_hidden,
        num_heads=spec.vision_heads,
        intermediate_size=spec.vision_mlp,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=TEMPORAL,
        in_channels=3,
        out_hidden_size=spec.text_hidden,
        window_size=112,
        fullatt_block_indexes=[spec.vision_layers - 1],
    )
    text = dict(
        vocab_size=len(QWEN_VOCAB),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "default",
            # a low base: M-RoPE gives the columns the slowest quarter of the frequencies, which
            # at 10000 turn less than 0.04 rad across a 10-token image, too little for a 32-wide
            # head to tell left from right
            "rope_theta": 100.0,
            "mrope_section": list(spec.text_mrope),
        },
        tie_word_embeddings=True,
        eos_token_id=IM_END,
        pad_token_id=QWEN_ID["<pad>"],
        bos_token_id=None,
    )
    return Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=True,
    )


# ---- organism-qwen35: Qwen3.5's hybrid decoder over organism-qwen's words and timestamps -------


@dataclass(frozen=True)
class Qwen35Spec:
    """Size of organism-qwen35. The decoder keeps Qwen3.5's pattern: three Gated-DeltaNet
    (``linear_attention``) layers, then one ``full_attention`` layer, ``text_layers // 4``
    times. ``rotary`` is the share of a full-attention head that rotates (Qwen3.5's 0.25 leaves
    a 32-wide head 4 frequencies, too few for the (t, h, w) sections), ``text_mrope`` its split."""

    vision_hidden: int = 64
    vision_layers: int = 3
    vision_heads: int = 4
    vision_mlp: int = 192
    vision_positions: int = 100  # the tower's learned 10 x 10 position grid, resampled per image
    text_hidden: int = 128
    text_layers: int = 8  # full attention at layers 3 and 7: the lookup, then the hop-2 read
    text_heads: int = 4
    text_kv_heads: int = 2
    text_head_dim: int = 32
    text_mlp: int = 320
    linear_heads: int = 4  # Gated-DeltaNet key and value heads
    linear_head_dim: int = 32
    rotary: float = 0.5
    text_mrope: tuple[int, int, int] = (2, 3, 3)


def build_qwen35_config(spec: Qwen35Spec = Qwen35Spec()):
    """``Qwen3_5Config`` of the given size over :data:`QWEN35_VOCAB`: a Qwen3-VL-style tower
    (patch 14 and merge 2 here, so that one merged token is organism-qwen's 28 px and its scenes
    and labels carry over) and the hybrid decoder (``full_attention_interval`` 4, tied
    embeddings)."""
    from transformers import Qwen3_5Config

    if spec.text_layers % 4:
        raise ValueError(f"text_layers={spec.text_layers}: the 3:1 pattern needs a multiple of 4")
    vision = dict(
        depth=spec.vision_layers,
        hidden_size=spec.vision_hidden,
        num_heads=spec.vision_heads,
        intermediate_size=spec.vision_mlp,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=TEMPORAL,
        in_channels=3,
        out_hidden_size=spec.text_hidden,
        num_position_embeddings=spec.vision_positions,
    )
    text = dict(
        vocab_size=len(QWEN35_VOCAB),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=spec.text_head_dim,
        linear_num_key_heads=spec.linear_heads,
        linear_num_value_heads=spec.linear_heads,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        full_attention_interval=4,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100.0,  # as organism-qwen's: a 10-token image must turn its columns
            "partial_rotary_factor": spec.rotary,
            "mrope_section": list(spec.text_mrope),
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        eos_token_id=IM_END,
        pad_token_id=QWEN_ID["<pad>"],
        bos_token_id=None,
    )
    return Qwen3_5Config(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=True,
    )


def build_qwen35_processor():
    """The stock ``Qwen3VLProcessor`` (Qwen3.5's): organism-qwen's image processor (patch 14,
    merge 2, each image at its own size), a Qwen3-VL video processor of the same geometry that
    keeps every clip frame at its own size, the word tokenizer over :data:`QWEN35_VOCAB` (the
    processor's frame timestamps included) and the ChatML template."""
    import transformers

    image_processor = build_qwen_processor().image_processor
    video_processor = transformers.Qwen3VLVideoProcessor(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=TEMPORAL,
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
        size={"shortest_edge": 4 * TOKEN * TOKEN, "longest_edge": CLIP_SIZE * CLIP_SIZE * FRAMES},
        do_sample_frames=False,
        cap_pixels_per_frame=True,  # the reference implementation's budget (qwen-vl-utils)
    )
    return transformers.Qwen3VLProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=build_qwen_tokenizer(QWEN35_VOCAB),
        chat_template=QWEN_TEMPLATE,
    )
