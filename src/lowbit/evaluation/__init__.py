"""Real-model accuracy of the quantization schemes: sentence-embedding agreement and AMCT's perplexity.

See docs/evaluation.md.
"""

from lowbit.evaluation.embeddings import compare_embeddings, sentence_embeddings
from lowbit.evaluation.models import LoadedModel, load_model, minilm_dir
from lowbit.evaluation.ppl import perplexity, tokenize_text, tokenize_text_file
from lowbit.evaluation.run import NothingQuantized, evaluate_schemes
from lowbit.evaluation.text import evaluation_and_calibration_sentences

__all__ = [
    "LoadedModel", "NothingQuantized", "compare_embeddings", "evaluate_schemes", "evaluation_and_calibration_sentences",
    "load_model", "minilm_dir", "perplexity", "sentence_embeddings", "tokenize_text", "tokenize_text_file",
]
