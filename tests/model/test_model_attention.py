"""MultiHeadAttention against trusted references (nn.MultiheadAttention, F.scaled_dot_product_attention,
a hand-written softmax(QK^T / sqrt(d_head)) V), and its two paths against each other. fp32, atol 1e-5."""

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from model.encoder import Encoder, MultiHeadAttention, packing
from tests.support.model_helpers import batch, key_mask, linear_rows, stock_mha, tiny

ATOL = 1e-5
CFG = tiny()


def _attention(seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    attn = MultiHeadAttention(CFG).eval()
    with torch.no_grad():  # non-zero biases, so a q/k/v mix-up in the fused projection shows
        attn.qkv.bias.normal_()
        attn.proj.bias.normal_()
    return attn


def _inputs(lengths: list[int], T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(lengths), T, CFG.d_model, generator=g), torch.tensor(lengths)


lengths_and_t = st.integers(1, 12).flatmap(
    lambda T: st.tuples(st.lists(st.integers(1, T), min_size=1, max_size=4), st.just(T))
)


@settings(max_examples=20, deadline=None)
@given(lt=lengths_and_t, causal=st.booleans(), need_weights=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_nn_multihead_attention(lt: tuple[list[int], int], causal: bool, need_weights: bool,
                                        seed: int) -> None:
    lengths, T = lt
    attn = _attention(seed % 7)
    x, lengths_t = _inputs(lengths, T, seed)
    mha = stock_mha(attn, CFG.d_model, CFG.n_heads)
    pad = torch.arange(T)[None, :] >= lengths_t[:, None]
    future = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        want, want_w = mha(x, x, x, key_padding_mask=pad, attn_mask=future, need_weights=True,
                           average_attn_weights=False)
        got, got_w = attn(x, key_mask(lengths_t, T, causal), need_weights)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if need_weights:
        torch.testing.assert_close(got_w, want_w, atol=ATOL, rtol=0)
    else:
        assert got_w is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_matches_nn_multihead_attention_without_padding(causal: bool, need_weights: bool) -> None:
    attn = _attention()
    x, lengths = _inputs([7, 7], 7, seed=5)
    mha = stock_mha(attn, CFG.d_model, CFG.n_heads)
    with torch.no_grad():
        want, _ = mha(x, x, x, attn_mask=torch.ones(7, 7, dtype=torch.bool).triu(1) if causal else None,
                      need_weights=False)
        got, _ = attn(x, key_mask(lengths, 7, causal), need_weights)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_path_matches_functional_sdpa(causal: bool) -> None:
    attn = _attention()
    x, lengths = _inputs([9, 4, 1], 9, seed=1)
    mask = key_mask(lengths, 9, causal)
    with torch.no_grad():
        q, k, v = F.linear(x, attn.qkv.weight, attn.qkv.bias).split(CFG.d_model, dim=2)
        q, k, v = (t.view(3, 9, CFG.n_heads, CFG.d_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # default scale: 1/sqrt(d_head)
        want = F.linear(y.transpose(1, 2).reshape(3, 9, CFG.d_model), attn.proj.weight, attn.proj.bias)
        got, _ = attn(x, mask, True)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@settings(max_examples=20, deadline=None)
@given(lt=lengths_and_t, causal=st.booleans(), seed=st.integers(0, 2**16))
def test_sdpa_path_equals_explicit_path(lt: tuple[list[int], int], causal: bool, seed: int) -> None:
    lengths, T = lt
    attn = _attention(seed % 5)
    x, lengths_t = _inputs(lengths, T, seed)
    mask = key_mask(lengths_t, T, causal)
    with torch.no_grad():
        fast, none = attn(x, mask, False)
        explicit, weights = attn(x, mask, True)
    assert none is None and weights is not None
    torch.testing.assert_close(fast, explicit, atol=ATOL, rtol=0)


def test_scale_is_one_over_sqrt_d_head() -> None:
    attn = _attention()
    x, lengths = _inputs([6, 6], 6, seed=2)
    with torch.no_grad():
        _, weights = attn(x, key_mask(lengths, 6, False), True)
        q, k, _ = F.linear(x, attn.qkv.weight, attn.qkv.bias).split(CFG.d_model, dim=2)
        q, k = (t.view(2, 6, CFG.n_heads, CFG.d_head).transpose(1, 2) for t in (q, k))
        logits = q @ k.transpose(-2, -1)
    assert weights is not None
    torch.testing.assert_close(weights, torch.softmax(logits / math.sqrt(CFG.d_head), -1), atol=1e-6, rtol=0)
    # The seed snippet's 1/sqrt(d_model) would be visibly different: this test can fail.
    assert (weights - torch.softmax(logits / math.sqrt(CFG.d_model), -1)).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_are_finite_zero_on_both_paths(dtype: torch.dtype, causal: bool) -> None:
    attn = _attention().to(dtype)
    x, lengths = _inputs([5, 0], 5, seed=3)
    mask = key_mask(lengths, 5, causal)
    with torch.no_grad():
        fast, _ = attn(x.to(dtype), mask, False)
        explicit, weights = attn(x.to(dtype), mask, True)
    assert weights is not None and weights.dtype == torch.float32
    for y in (fast, explicit):
        assert torch.isfinite(y).all()
        # No key to attend to: the head outputs are 0, so the layer output is the projection's bias.
        torch.testing.assert_close(y[1].float(), attn.proj.bias.float().expand(5, -1), atol=0, rtol=0)
    assert torch.equal(weights[1], torch.zeros_like(weights[1]))


def test_fully_masked_rows_are_zeroed_even_if_the_kernel_gives_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's memory-efficient SDPA has returned NaN for query rows with no key (pytorch#110213); CPU
    kernels return 0. Fake the CUDA behaviour: the output must still be finite, and 0 before the projection."""
    real_sdpa = F.scaled_dot_product_attention

    def nan_for_empty_rows(q, k, v, attn_mask=None, scale=None):  # noqa: ANN001, ANN202
        y = real_sdpa(q, k, v, attn_mask=attn_mask, scale=scale)
        return y.masked_fill(~attn_mask.any(dim=-1, keepdim=True), float("nan"))

    monkeypatch.setattr(F, "scaled_dot_product_attention", nan_for_empty_rows)
    attn = _attention()
    x, lengths = _inputs([4, 0], 4, seed=4)
    with torch.no_grad():
        y, _ = attn(x, key_mask(lengths, 4, causal=True), False)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], attn.proj.bias.expand(4, -1))


# -- unpadded batches: SDPA without a mask (flash-eligible on CUDA) ---------------------------------

def _sdpa_mask_shapes(fn: Callable[[], object]) -> list[list[int]]:
    """The attn_mask shape of every SDPA call fn() makes ([] where none is passed), read with the profiler,
    which sees scripted modules as well as eager ones."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [e.input_shapes[3] for e in prof.events() if e.name == "aten::scaled_dot_product_attention"]


def _masked_reference(enc: Encoder, ids: torch.Tensor, lengths: torch.Tensor, causal: bool) -> torch.Tensor:
    """Encoder.forward as it was before the mask-free path: every SDPA layer given the mask."""
    T = ids.shape[1]
    x = enc.tok_emb(ids) + enc.pos_emb[:T]
    mask = key_mask(lengths, T, causal)
    for block in enc.blocks:
        x, _ = block(x, mask, False)
    return enc.ln_f(x)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 9])
def test_unpadded_attention_without_a_mask_equals_the_masked_one(causal: bool, T: int) -> None:
    attn = _attention()
    x, lengths = _inputs([T, T, T], T, seed=6)
    mask = key_mask(lengths, T, causal)
    for module in (attn, torch.jit.script(attn)):
        with torch.no_grad():
            masked, _ = module(x, mask, False)
            free, none = module(x, mask, False, True)
            explicit, _ = module(x, mask, True, True)  # the explicit path ignores the flag
        assert none is None
        torch.testing.assert_close(free, masked, atol=ATOL, rtol=0)
        torch.testing.assert_close(free, explicit, atol=ATOL, rtol=0)


Encoders = tuple[Encoder, torch.jit.ScriptModule]


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    """A pre-LN TINY encoder with a final norm, eager and scripted (as model/bundle.py saves it)."""
    enc = Encoder(tiny(norm_first=True, final_norm=True)).init_weights(3).eval()
    return enc, torch.jit.script(enc)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
def test_unpadded_batch_takes_the_mask_free_path_and_equals_the_masked_one(encoders: Encoders, causal: bool,
                                                                          scripted: bool) -> None:
    enc, module = encoders[0], encoders[1] if scripted else encoders[0]
    ids, lengths = batch(enc.config, [11, 11, 11], seed=7)
    with torch.inference_mode():
        want = _masked_reference(enc, ids, lengths, causal)
        got, _ = module(ids, None, lengths, causal, [])
        shapes = _sdpa_mask_shapes(lambda: module(ids, None, lengths, causal, []))
        longer, _ = module(ids, None, lengths + 5, causal, [])  # lengths past T: no padding either
    assert shapes == [[]] * enc.n_layers  # no mask passed to any layer
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert torch.equal(longer, got)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
def test_a_mixed_batch_keeps_the_mask_and_equals_each_sequence_alone(encoders: Encoders, causal: bool,
                                                                     scripted: bool) -> None:
    enc, module = encoders[0], encoders[1] if scripted else encoders[0]
    lengths = [11, 4, 11, 1]
    ids, lengths_t = batch(enc.config, lengths, seed=8)
    with torch.inference_mode():
        got, _ = module(ids, None, lengths_t, causal, [])
        shapes = _sdpa_mask_shapes(lambda: module(ids, None, lengths_t, causal, []))
        want = _masked_reference(enc, ids, lengths_t, causal)
        for row, n in enumerate(lengths):  # each alone is unpadded: the mask-free path
            torch.testing.assert_close(got[row, :n], want[row, :n], atol=ATOL, rtol=0)
            alone, _ = module(ids[row : row + 1, :n], None, torch.tensor([n]), causal, [])
            torch.testing.assert_close(got[row, :n], alone[0], atol=ATOL, rtol=0)
            assert not got[row, n:].any()  # padded rows: zeros (packed, they were never computed)
    assert shapes == [[4, 1, 11 if causal else 1, 11]] * enc.n_layers


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
def test_a_padded_batch_runs_the_position_wise_layers_on_its_real_tokens_only(encoders: Encoders, scripted: bool,
                                                                            need_weights: bool) -> None:
    enc, module = encoders[0], encoders[1] if scripted else encoders[0]
    lengths = [11, 4, 0, 7]
    ids, lengths_t = batch(enc.config, lengths, seed=9)
    layers = [0] if need_weights else []
    with torch.inference_mode():
        rows = linear_rows(lambda: module(ids, None, lengths_t, False, layers))
        full = linear_rows(lambda: module(ids, None, torch.full((4,), 11), False, layers))
        # one token of padding in 16 x 11: too little to be worth the gathers (PACK_MIN_PADDING)
        little = linear_rows(lambda: module(ids.repeat(4, 1)[:, :11], None, torch.tensor([11] * 15 + [10]),
                                             False, layers))
    # qkv, proj, fc1, fc2 per layer, each on the 22 real tokens rather than 4 x 11
    assert rows == [sum(lengths)] * (4 * enc.n_layers)
    assert full == [4 * 11] * (4 * enc.n_layers)
    assert little == [16 * 11] * (4 * enc.n_layers)


def test_packing_maps_the_grid_to_real_tokens_and_padding_to_a_real_token_of_its_row() -> None:
    # rows of 3, 0, 5 (past T: full) and 2 tokens in a grid of T = 4
    tokens, grid = packing(torch.tensor([3, 0, 5, 2]), 4)
    assert tokens.tolist() == [0, 1, 2, 8, 9, 10, 11, 12, 13]
    # row 0 pads with its last token, the empty row reads the next row's first, the last row its last
    assert grid.tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 3, 4, 5, 6, 7, 8, 8, 8]
    assert torch.equal(grid[tokens], torch.arange(9))  # each real position reads its own token
