"""vlm_focus: attention-driven visual-token pruning, grounding and hallucination mitigation."""

__version__ = "0.1.0"
