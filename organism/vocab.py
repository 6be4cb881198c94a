"""Vocabulary, tokenizer, processor and model configs of the organism VLMs.

The tokenizer is a word-level `tokenizers` model built from the scene vocabulary: every category
(`red_circle`) and every coarse position (`top_left`) is one token. The processor is a stock
`LlavaProcessor` (CLIP image geometry), so `AutoProcessor.from_pretrained(path)` loads it offline.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlm_focus.asset_paths import CAPTION_PROMPT as CAPTION_PROMPT  # the organisms' caption prompt

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


SPECS: dict[str, OrganismSpec] = {
    "default": OrganismSpec("organism-default", text_hidden=256, text_heads=8, text_mlp=1024),
    "guide": OrganismSpec(
        "organism-guide",
        patch=32,
        vision_hidden=128,
        vision_layers=3,
        vision_heads=4,
        text_hidden=160,
        text_layers=3,
        text_heads=5,
        text_mlp=640,
    ),
    # a deeper, narrower LM: eight layers, so that the two-hop read can sit after layer 2
    "deep": OrganismSpec(
        "organism-deep", text_hidden=160, text_layers=8, text_heads=5, text_mlp=576
    ),
    # a guide for the deep model: organism-guide's tower (6 x 6 tokens) and a 4-layer LM, deep
    # enough for the two-hop read (layers 2-3)
    "twohop-guide": OrganismSpec(
        "organism-twohop-guide",
        patch=32,
        vision_hidden=128,
        vision_layers=3,
        vision_heads=4,
        text_hidden=160,
        text_layers=4,
        text_heads=5,
        text_mlp=480,
    ),
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
