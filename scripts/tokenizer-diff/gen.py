"""Random strings for the tokenizer comparison, one JSON string a line:
words, contractions, whitespace runs, digits, punctuation, accented Latin,
Cyrillic, CJK, Arabic and Hebrew, emoji sequences, combining marks,
zero-width and control characters, special-token texts, random code points.

    python3 gen.py SEED COUNT > strings.jsonl"""
import json, random, sys
seed = int(sys.argv[1]); n = int(sys.argv[2])
r = random.Random(seed)
WORDS = "the quick brown fox jumps over lazy dog Hello World HTTP URL JSON iPhone camelCase snake_case foo bar baz lorem ipsum dolor sit amet a I x y z".split()
CONTR = ["'s", "'re", "'ll", "'ve", "'m", "'t", "'d", "'S", "'RE", "'LL", "'VE", "'M", "'T", "'D", "'Re", "'Ll", "n't", "'"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "--", "->", "=>", "!=", "::", "//", "/*", "*/", "```", "\u2014", "\u201c", "\u201d", "\u2019", "\u00ab", "\u00bb", "\u3002", "\uff0c"]
ACC = "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u00e7a \u00e5\u00e4\u00f6 \u00d1and\u00fa \u0141\u00f3d\u017a \u0159e\u0161\u011b \u00c6gir \u0153uvre".split()
CYR = "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 \u0441\u043b\u043e\u0432\u043e \u0401\u0436 \u0449\u0438".split()
CJK = ["\u4f60\u597d", "\u4e16\u754c", "\u6f22\u5b57", "\u65e5\u672c\u8a9e", "\u3053\u3093\u306b\u3061\u306f", "\u30ab\u30bf\u30ab\u30ca", "\ud55c\uad6d\uc5b4", "\U00020000\U0002a6d6"]
ARHE = ["\u0645\u0631\u062d\u0628\u0627", "\u0627\u0644\u0639\u0627\u0644\u0645", "\u05e9\u05dc\u05d5\u05dd", "\u05e2\u05d5\u05dc\u05dd", "\u0661\u0662\u0663"]
EMOJI = ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466", "\u2764\ufe0f", "\U0001F1FA\U0001F1F8", "\U0001F3F3\ufe0f\u200D\U0001F308", "\U0001F9D1\U0001F3FF\u200D\U0001F4BB", "\u263a", "\U0001F525"*3]
COMB = ["e\u0301", "a\u0308", "n\u0303", "\u0301", "o\u0302\u0323", "\u0915\u094d\u0937", "\u0e01\u0e34", "Z\u0351\u036b\u0343\u036a"]
ZW = ["\u200b", "\u200c", "\u200d", "\ufeff", "\u2060", "\u00ad", "\u00a0", "\u3000", "\u2028", "\u2029", "\u0085", "\u202f", "\u2009"]
CTRL = [chr(c) for c in range(0x20) if c not in (0x0a, 0x09, 0x0d)] + ["\x7f", "\x80", "\x9f"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>", "<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>", "<|fim_prefix|>", "<repo_name>", "<|im_start", "im_start|>", "< s>", "<|endoftext|", "<pad>"]
WS = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", " \t ", "\n\n\n", "        ", "\t\t", "\r"]
def digits(): return "".join(r.choice("0123456789") for _ in range(r.randint(1, 25)))
def longword(): return "".join(r.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(r.randint(20, 200)))
def randuni():
    while True:
        c = r.choice([r.randint(0x20, 0x7e), r.randint(0xa0, 0x2fff), r.randint(0x3000, 0xd7ff), r.randint(0xe000, 0xfffd), r.randint(0x10000, 0x10ffff), 0xfffd])
        if not (0xd800 <= c <= 0xdfff): return chr(c)
GENS = [
 (20, lambda: r.choice(WORDS)), (4, lambda: r.choice(WORDS).upper()), (6, lambda: r.choice(CONTR)),
 (8, lambda: r.choice(WS)), (5, digits), (6, lambda: r.choice(PUNCT)), (3, lambda: r.choice(ACC)),
 (2, lambda: r.choice(CYR)), (2, lambda: r.choice(CJK)), (2, lambda: r.choice(ARHE)), (2, lambda: r.choice(EMOJI)),
 (2, lambda: r.choice(COMB)), (2, lambda: r.choice(ZW)), (2, lambda: r.choice(CTRL)), (1, lambda: "\ufffd"),
 (1, longword), (3, lambda: r.choice(SPECIAL)), (2, randuni),
]
TOT = sum(w for w, _ in GENS)
def piece():
    x = r.uniform(0, TOT)
    for w, g in GENS:
        x -= w
        if x <= 0: return g()
    return GENS[-1][1]()
def sample():
    k = r.random()
    if k < 0.05: return "".join(r.choice(WS + ZW) for _ in range(r.randint(1, 8)))      # whitespace-only
    if k < 0.10: return r.choice(SPECIAL) + "".join(piece() for _ in range(r.randint(0, 5)))  # special at start
    if k < 0.15: return "".join(randuni() for _ in range(r.randint(1, 12)))
    parts = []
    for _ in range(r.randint(1, 14)):
        parts.append(piece())
        if r.random() < 0.5: parts.append(" ")
    s = "".join(parts)
    if r.random() < 0.2: s = r.choice(WS) + s
    if r.random() < 0.2: s = s + r.choice(WS)
    return s
out = ["", " ", "Hello world", "hello", " Hello", "The quick brown fox jumps over the lazy dog.", "I can't believe it's not butter", "a b c", "12345", "Hello, world! How are you?"]
while len(out) < n: out.append(sample())
for s in out: print(json.dumps(s, ensure_ascii=True))
