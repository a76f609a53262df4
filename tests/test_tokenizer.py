"""ck.Tokenizer against transformers' AutoTokenizer (ids recorded in tests/fixtures/tokenizer_shakespeare/expected.json
by tests/fixtures/make_tokenizer.py), the byte tokenizer, streaming decode, and bad input."""
import json
from pathlib import Path

import numpy as np
import pytest

import cukernels as ck
from cukernels.tokenizer import ByteTokenizer, TextStream

FIX = Path(__file__).resolve().parent / "fixtures" / "tokenizer_shakespeare"
EXPECTED = json.loads((FIX / "expected.json").read_text(encoding="utf-8"))
tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers (the 'tokenizers' extra)")


@pytest.fixture(scope="module")
def tok():
    return ck.Tokenizer.from_pretrained(FIX)


def test_special_tokens_and_size_match_transformers(tok):
    assert tok.vocab_size == EXPECTED["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        EXPECTED["bos_token_id"], EXPECTED["eos_token_id"], EXPECTED["pad_token_id"])


@pytest.mark.parametrize("i", range(len(EXPECTED["samples"])))
def test_encode_decode_match_transformers(tok, i):
    s = EXPECTED["samples"][i]
    assert tok.encode(s["text"]) == s["ids"]
    assert tok.encode(s["text"], add_special_tokens=False) == s["ids_plain"]
    assert tok.decode(s["ids"]) == s["decoded"]
    assert tok.decode(s["ids"], skip_special_tokens=True) == s["decoded_skip"]
    assert tok.decode(np.array(s["ids"], np.int64)) == s["decoded"]


def test_encode_batch(tok):
    texts = [s["text"] for s in EXPECTED["samples"]]
    assert tok.encode_batch(texts) == [s["ids"] for s in EXPECTED["samples"]]


def test_stream_releases_whole_characters(tok):
    text = "héllo wörld ✓ 🙂 and more"
    for t in (tok, ByteTokenizer()):
        ids = t.encode(text, add_special_tokens=False)
        st = TextStream(t)
        pieces = [st.push(i) for i in ids] + [st.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
    st = TextStream(ByteTokenizer())
    assert st.push("🙂".encode()[0]) == ""  # the first byte of a 4-byte character alone prints nothing


def test_byte_tokenizer():
    b = ByteTokenizer()
    assert b.encode("hé") == [104, 195, 169] and b.decode([104, 195, 169]) == "hé"
    assert b.vocab_size == 256 and b.bos_token_id is None
    with pytest.raises(ValueError, match=r"ids: byte tokens are 0\.\.255; got 256"):
        b.decode([1, 256])


def test_a_byte_model_folder_gets_the_byte_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256}))
    assert isinstance(ck.Tokenizer.from_pretrained(tmp_path), ByteTokenizer)


@pytest.mark.parametrize("call,err,match", [
    (lambda t: t.encode(3), TypeError, r"^text: expected a string"),
    (lambda t: t.encode("a", add_special_tokens="yes"), TypeError, r"^add_special_tokens:"),
    (lambda t: t.decode("abc"), TypeError, r"^ids: expected a sequence of integer token ids"),
    (lambda t: t.decode([1, 2.5]), TypeError, r"^ids\[1\]: expected an integer"),
    (lambda t: t.decode([1, -1]), ValueError, r"^ids\[1\]: expected an integer >= 0"),
    (lambda t: t.decode([1, 512]), ValueError, r"^ids: token ids must be < vocab_size=512; got 512"),
    (lambda t: t.decode(np.zeros((2, 2), np.int32)), TypeError, r"^ids: expected a 1-D array"),
    (lambda t: t.encode_batch("abc"), TypeError, r"^texts: expected a list of strings"),
])
def test_bad_input(tok, call, err, match):
    with pytest.raises(err, match=match):
        call(tok)


def test_bad_folders(tmp_path):
    with pytest.raises(TypeError, match=r"^folder: expected a path"):
        ck.Tokenizer.from_pretrained(3)
    with pytest.raises(ValueError, match=r"is not a folder"):
        ck.Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        ck.Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"is not a valid tokenizer\.json"):
        ck.Tokenizer.from_pretrained(tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    (good / "tokenizer.json").write_text((FIX / "tokenizer.json").read_text(encoding="utf-8"))
    (good / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"bos_token: '<\|nope\|>' is not in the tokenizer's vocabulary"):
        ck.Tokenizer.from_pretrained(good)


# ------------------------------------------------------------------------------------------------ FastEncoder
# The data preparation's encoder must give tokenizers' ids exactly: checked on tokenizers built here with tokenizers'
# own trainer (tiny vocabularies, trained on tinyshakespeare and the adversarial text) in the pipelines it recognises
# (GPT-2's ByteLevel; Llama-3's and Qwen2's Split + ByteLevel, NFC; GPT-4o's pattern; a pattern it does not know),
# on tinyshakespeare, adversarial text and seeded random text, through both of its paths.
from cukernels.tokenizer import SPACE_SAFE_PATTERNS, FastEncoder, GPT2_PATTERN, _ascii_pattern  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "tinyshakespeare.txt"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# a Split pattern the fast path does not know (no space-separated parts) and that leaves gaps (kept as pre-tokens)
OTHER = r"\p{L}+|\p{N}{1,2}|[^\s\p{L}\p{N}]"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|reserved_special_token_0|>", "<|end|>"]
ADVERSARIAL = [
    "", " ", "  ", "\n", "\r\n", "a", "'s", "x" * 5000, "9" * 1001, " " * 777 + "x", "\t" * 50, "\n" * 40 + "a",
    "Hello world!  Two  spaces,\tand\ttabs.\nNew line\r\nCRLF\r\n\r\nend  \n  \n indented \n",
    "I'm you're we've they'll he'd it's I'M YOU'RE WE'VE THEY'LL HE'D IT'S 'Ś 'ſ 'S'T ''s x's'd",
    "123 4567 89012345 3.14159 1,000,000 ٣٤٥٦٧ ０１２ ½ ² Ⅻ 12ab34 a1b2c3 007",
    "中文字符测试 日本語のテキスト 한국어 텍스트 Ελληνικά русский עברית العربية हिन्दी ไทย ພາສາລາວ",
    "e\u0301 A\u030a \u212b \u1e9b\u0323 ﬁ ｆｕｌｌ \u0041\u0308\u0301 Å Å é é \u0958 \uac00\u11a8",
    "🙂👍🏽 👨\u200d👩\u200d👧 🇫🇷🇩🇪 ✓ — “quoted” ‘single’ «guillemets» … ™ © ∑ ∫ ≈",
    "\x00\x01\x1c\x1d\x1e\x1f\x7f \x85 \u00a0 \u1680 \u2000\u2001\u200a \u2028\u2029 \u202f \u205f \u3000 \ufeff"
    " \u200b \u180e x\u00a0y x\u2003y x\u3000y \x0b\x0c\x0b x\x85y",
    "<|endoftext|>", "a<|endoftext|>b", "<|endoftext|><|endoftext|>", " <|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext", "<|end|>oftext|>", "<|<|endoftext|>|>", "text <|reserved_special_token_0|> more <|end|>",
    "https://example.com/a?b=c&d=e#f foo_bar fooBar FOO_BAR x=1;y=2 ' '' ''' \"\"\" `code` **bold** [l](u)",
    "def f(x):\n    return x  # comment\n\n\tclass A:\n\t\tpass\n    \n",
    "mixed   \n\n  \r\n\t \x0b end.\n\n\nNext. \nOne\n/two .\n/three",
    "ÀÉÎÕÜ àéîõü ß ẞ ǅ ǈ ǋ Σσς İı ﬀ Ǆǆ ʰʲ ᵃᵇ ˈˌ ꜰ 𝐀𝐁𝐂 𝟘𝟙 𐐀𐐨",
]


def _chars_pool():
    pool = list("abcXYZ019 '\n\r\t.,;!?-_/\\\"()[]{}<>|&%$#@") + list("éÉßſΣσς中文🙂٣½²\u0301\u00a0\u3000\u2028\x85")
    return pool + [" ", " ", "  ", "'s", "'LL", "\r\n", "\n\n", "  \n", "<|endoftext|>", "<|end|>", "123456"]


def _random_texts(n, seed=0):
    rng = np.random.default_rng(seed)
    pool = _chars_pool()
    return ["".join(pool[i] for i in rng.integers(0, len(pool), size=int(rng.integers(0, 120)))) for _ in range(n)]


def _train(pattern=None, normalizer=None, specials=SPECIALS, vocab=600, added=(), byte_level_regex=False):
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(ignore_merges=pattern == LLAMA3))
    if normalizer:
        tok.normalizer = getattr(normalizers, normalizer)()
    if pattern is None or byte_level_regex:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    sample = TEXT.read_text(encoding="utf-8")[:150000] + "\n".join(ADVERSARIAL) * 3
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([sample], trainer)
    if added:
        tok.add_tokens(list(added))
    return ck.Tokenizer(tok, eos_token=specials[0] if specials else None)


PIPELINES = {
    "gpt2": dict(),
    "llama3": dict(pattern=LLAMA3),
    "qwen2-nfc": dict(pattern=QWEN2, normalizer="NFC"),
    "o200k-nfkc": dict(pattern=O200K, normalizer="NFKC"),
    "other-pattern": dict(pattern=OTHER),
}


@pytest.fixture(scope="module", params=list(PIPELINES))
def pipeline(request):
    return request.param, _train(**PIPELINES[request.param])


def _want(tok, text):
    return tok._tok.encode(text, add_special_tokens=False).ids


def test_fast_encoder_equals_tokenizers_on_adversarial_text(pipeline):
    name, tok = pipeline
    enc = FastEncoder(tok)
    assert enc.space_safe == (name != "other-pattern")
    for text in ADVERSARIAL + ["\n".join(ADVERSARIAL), " ".join(ADVERSARIAL)]:
        assert enc.encode(text).tolist() == _want(tok, text), repr(text[:80])
    assert enc.encode("").dtype == np.uint32 and enc.encode("").size == 0


def test_fast_encoder_equals_tokenizers_on_random_text(pipeline):
    _, tok = pipeline
    enc = FastEncoder(tok)
    texts = _random_texts(300)
    for text in texts:
        assert enc.encode(text).tolist() == _want(tok, text), repr(text)
    joined = " ".join(texts)
    assert enc.encode(joined).tolist() == _want(tok, joined)


def test_fast_encoder_ascii_stretches_and_a_tiny_cache(pipeline):
    """Pre-tokens cut by ASCII stretches (re) and non-ASCII windows (regex) are the Unicode pattern's over the whole
    text, on a text with non-ASCII characters sprinkled into tinyshakespeare; the ids stay exact with a cache
    emptied every five entries."""
    _, tok = pipeline
    enc = FastEncoder(tok, max_entries=5)
    rng = np.random.default_rng(1)
    text = TEXT.read_text(encoding="utf-8")[:200000]
    extra = list("é中😀\u0301’—\u00a0\u3000") + [" é ", "  中  ", "\n😀\n", "x’s", " — ", "é é", "\u0301 x"]
    cuts = sorted(rng.integers(0, len(text), 150))
    mixed = "".join(text[a:b] + extra[rng.integers(len(extra))] for a, b in zip([0] + cuts, cuts + [len(text)]))
    if enc.space_safe:
        assert enc._pretokens(mixed) == enc._pat.findall(mixed)
    for t in [mixed[:20000]] + _random_texts(100, seed=1) + ADVERSARIAL:
        assert enc.encode(t).tolist() == _want(tok, t), repr(t[:80])
    assert len(enc._words) <= 5


def test_fast_encoder_on_tinyshakespeare():
    tok = ck.Tokenizer.from_pretrained(FIX)
    enc = FastEncoder(tok)
    text = TEXT.read_text(encoding="utf-8")
    assert enc.encode(text).tolist() == tok.encode(text, add_special_tokens=False)
    assert enc.encode(text).tolist() == tok.encode(text, add_special_tokens=False)  # again, from the caches


def test_fast_encoder_gpt2_pipeline_with_normalized_added_tokens():
    """GPT-2's <|endoftext|> is an added token with normalized=True: matched on the normalized text."""
    from tokenizers import AddedToken

    tok = _train(normalizer="NFKC", specials=["<|endoftext|>"],
                 added=[AddedToken("ﬁne", normalized=True), AddedToken("<raw>", normalized=False),
                        AddedToken("fine<raw", normalized=True)])
    enc = FastEncoder(tok)
    for text in ADVERSARIAL + ["ﬁne fine ﬁnest <raw> fine<raw> <raw<raw>> x<|endoftext|>ﬁne"] + _random_texts(50, 2):
        assert enc.encode(text).tolist() == _want(tok, text), repr(text)


def test_fast_encoder_characters_newer_than_pythons_unicode_database():
    """A character unassigned in this Python's Unicode database (a newer letter, maybe) goes to tokenizers."""
    tok = _train(pattern=LLAMA3)
    enc = FastEncoder(tok)
    for c in ("\u0378", "\U0001fae8", "\U00016100", "\U000e0100", "\U0010fffd"):
        text = f"abc {c} d{c}e\n{c}{c} 12{c}3"
        assert enc.encode(text).tolist() == _want(tok, text)


@pytest.mark.parametrize("pattern", sorted(SPACE_SAFE_PATTERNS))
def test_ascii_patterns_split_ascii_text_as_the_unicode_ones(pattern):
    import regex

    uni, asc = regex.compile(pattern), _ascii_pattern(pattern)
    assert asc is not None
    rng = np.random.default_rng(3)
    pool = [chr(i) for i in range(128)] + ["'s", "'S", "'ll", "'LL", "'Ve", " ", "  ", "\r\n", "\n", "ab", "12345"]
    for _ in range(300):
        s = "".join(pool[i] for i in rng.integers(0, len(pool), size=int(rng.integers(0, 80))))
        assert asc.findall(s) == uni.findall(s), repr(s)
    assert pattern == GPT2_PATTERN or "\\p{N}" in pattern


@pytest.mark.parametrize("what,change,reason", [
    ("add_prefix_space", lambda c: c["pre_tokenizer"].update(add_prefix_space=True), "add_prefix_space"),
    ("lstrip", lambda c: c["added_tokens"][0].update(lstrip=True), "lstrip"),
    ("metaspace", lambda c: c.update(pre_tokenizer={"type": "Metaspace", "replacement": "\u2581",
                                                    "prepend_scheme": "always", "split": True}), "pre-tokenizer"),
    ("lowercase", lambda c: c.update(normalizer={"type": "Lowercase"}), "normalizer"),
    ("dropout", lambda c: c["model"].update(dropout=0.1), "dropout"),
])
def test_fast_encoder_refuses_pipelines_it_does_not_reproduce(what, change, reason):
    tok = ck.Tokenizer.from_pretrained(FIX)
    conf = json.loads(tok._tok.to_str())
    change(conf)
    other = ck.Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(conf)))
    with pytest.raises(ValueError, match=reason):
        FastEncoder(other)


def test_fast_encoder_bad_arguments():
    with pytest.raises(TypeError, match=r"^tokenizer: expected a Tokenizer"):
        FastEncoder(ByteTokenizer())
    with pytest.raises(ValueError, match=r"^max_entries:"):
        FastEncoder(ck.Tokenizer.from_pretrained(FIX), max_entries=0)
    with pytest.raises(TypeError, match=r"^text: expected a string"):
        FastEncoder(ck.Tokenizer.from_pretrained(FIX)).encode(b"bytes")
