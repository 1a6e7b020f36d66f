//! The tokenizer on small hand-made byte-level vocabularies: what each
//! pre-tokenizer does to digits and whitespace, special tokens, BOS/EOS,
//! round trips, the streaming decoder and the chat template.

use kvjit_tokenizer::{ChatMessage, EncodeOptions, TokenKind, Tokenizer, TokenizerError, VocabSpec};

/// GPT-2's byte alphabet, as the tests spell it (independently of the
/// crate's table): printable bytes as themselves, the rest from U+0100 on.
fn byte_chars() -> Vec<char> {
    let mut next = 0;
    (0..=255u32)
        .map(|b| {
            if (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(255 + next).unwrap()
            }
        })
        .collect()
}

/// Special tokens first (as in SmolLM2: `<|endoftext|>` 0, `<|im_start|>` 1,
/// `<|im_end|>` 2), a user-defined token, the 256 byte tokens, then one token
/// per merge, plus `extra` tokens no merge makes.
const SPECIALS: &[(&str, i32)] = &[("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4)];

const MERGES: &[&str] = &[
    "h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d", "1 2", "3 4", "4 5", "Ġ Ġ", "Ġ b",
    "ð Ł", "Ċ Ċ", "u s", "us e", "use r",
];

fn spec(pre: &str, extra: &[&str]) -> VocabSpec {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|(t, _)| t.to_string()).collect();
    let mut types: Vec<i32> = SPECIALS.iter().map(|&(_, k)| k).collect();
    for c in byte_chars() {
        tokens.push(c.to_string());
        types.push(1);
    }
    for m in MERGES {
        let merged = m.replace(' ', "");
        if !tokens.contains(&merged) {
            tokens.push(merged);
            types.push(1);
        }
    }
    for e in extra {
        tokens.push(e.to_string());
        types.push(1);
    }
    VocabSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        merges: MERGES.iter().map(|m| m.to_string()).collect(),
        token_types: Some(types),
        bos: Some(1),
        eos: Some(2),
        add_bos: Some(false),
        add_space_prefix: None,
        chat_template: Some(SMOLLM2_TEMPLATE.into()),
        scores: None,
    }
}

fn tok(pre: &str) -> Tokenizer {
    Tokenizer::from_spec(spec(pre, &[])).unwrap()
}

/// The token texts of `ids`.
fn texts(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter().map(|&i| t.token_text(i).unwrap().to_string()).collect()
}

fn encode_texts(t: &Tokenizer, text: &str) -> Vec<String> {
    texts(t, &t.encode(text, false).unwrap())
}

/// SmolLM2-135M-Instruct's `tokenizer.chat_template`.
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const SAMPLES: &[&str] = &[
    "hello world",
    "Hello, World! It's a test; we've got 3 cases.",
    "12345 and 1234567890 and 3.14159",
    "a   b\t\tc\n\n\nd  \n e    ",
    "   leading and trailing   ",
    "\r\n\r\nwindows\r\nlines",
    "Grüße, naïve café — «ça va?» ½ × ∞",
    "日本語のテキスト、中文字符，한국어",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧 and flags 🇫🇷",
    "مرحبا بالعالم",
    "",
    " ",
    "\u{0}\u{7f}\u{80}\u{ffff}",
];

#[test]
fn merges_apply_by_rank_within_words() {
    let t = tok("smollm");
    assert_eq!(encode_texts(&t, "hello world"), ["hello", "Ġworld"]);
    assert_eq!(encode_texts(&t, "hello"), ["hello"]);
    assert_eq!(t.decode(&t.encode("hello world", false).unwrap()).unwrap(), "hello world");
}

#[test]
fn digits_split_as_each_pre_tokenizer_says() {
    // smollm: every digit alone, so the merge "1 2" never applies.
    assert_eq!(encode_texts(&tok("smollm"), "12345"), ["1", "2", "3", "4", "5"]);
    // gpt2: one word of digits: merges "1 2" then "3 4" (rank before "4 5").
    assert_eq!(encode_texts(&tok("gpt2"), "12345"), ["12", "34", "5"]);
    assert_eq!(encode_texts(&tok("gpt-2"), "12345"), ["12", "34", "5"]);
    // llama-bpe: runs of at most three digits: "123" "45".
    assert_eq!(encode_texts(&tok("llama-bpe"), "12345"), ["12", "3", "45"]);
    // smollm: a space before digits is its own word.
    assert_eq!(encode_texts(&tok("smollm"), "a 12"), ["a", "Ġ", "1", "2"]);
    assert_eq!(encode_texts(&tok("gpt2"), "a 12"), ["a", "Ġ", "12"]);
}

#[test]
fn whitespace_runs_leave_one_space_for_the_next_word() {
    // `\s+(?!\S)`: "a   b" is "a", "  ", " b" (not "a", "   ", "b").
    for pre in ["smollm", "gpt2", "llama-bpe"] {
        let t = tok(pre);
        assert_eq!(encode_texts(&t, "a   b"), ["a", "ĠĠ", "Ġb"], "{pre}");
        // Trailing whitespace is one word.
        assert_eq!(encode_texts(&t, "a  "), ["a", "ĠĠ"], "{pre}");
    }
    // llama-bpe groups newlines: "\n\n" is one word, merged by "Ċ Ċ"; in
    // gpt2 too (`\s+(?!\S)` at the end of the text).
    assert_eq!(encode_texts(&tok("llama-bpe"), "a\n\nb"), ["a", "ĊĊ", "b"]);
    assert_eq!(encode_texts(&tok("gpt2"), "a\n\n"), ["a", "ĊĊ"]);
}

#[test]
fn llama_bpe_takes_a_whole_word_token_without_merges() {
    let extra = ["xyz"];
    let llama = Tokenizer::from_spec(spec("llama-bpe", &extra)).unwrap();
    assert_eq!(encode_texts(&llama, "xyz"), ["xyz"]);
    let smollm = Tokenizer::from_spec(spec("smollm", &extra)).unwrap();
    assert_eq!(encode_texts(&smollm, "xyz"), ["x", "y", "z"]);
}

#[test]
fn round_trips() {
    for pre in ["smollm", "gpt2", "llama-bpe", "qwen2", "default"] {
        let t = tok(pre);
        for s in SAMPLES {
            let ids = t.encode(s, false).unwrap();
            assert_eq!(&t.decode(&ids).unwrap(), s, "{pre}: {s:?} -> {ids:?}");
            let ids = t.encode(s, true).unwrap();
            assert_eq!(&t.decode(&ids).unwrap(), s, "{pre} (special): {s:?}");
        }
    }
}

#[test]
fn emoji_and_unicode_are_their_utf8_bytes() {
    let t = tok("smollm");
    // 😀 is F0 9F 98 80: "ð Ł" merges its first two bytes.
    let ids = t.encode("😀", false).unwrap();
    assert_eq!(texts(&t, &ids), ["ðŁ", "ĺ", "Ģ"]);
    let bytes: Vec<u8> = ids.iter().flat_map(|&i| t.token_bytes(i).unwrap().to_vec()).collect();
    assert_eq!(bytes, "😀".as_bytes());
}

#[test]
fn special_tokens_are_whole_only_when_parsed() {
    let t = tok("smollm");
    let text = "<|im_start|>user\nhi<|im_end|>";
    let ids = t.encode(text, true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(*ids.last().unwrap(), 2);
    assert_eq!(texts(&t, &ids[1..2]), ["user"]);
    assert_eq!(t.decode(&ids).unwrap(), text);
    assert_eq!(t.decode_with(&ids, true).unwrap(), "user\nhi");

    // Not parsed: plain text, never ids 1 or 2, and still a round trip.
    let plain = t.encode(text, false).unwrap();
    assert!(!plain.contains(&1) && !plain.contains(&2), "{plain:?}");
    assert_eq!(texts(&t, &plain[..3]), ["<", "|", "i"]);
    assert_eq!(t.decode(&plain).unwrap(), text);

    // A user-defined token is always whole.
    let ids = t.encode("a<tool>b", false).unwrap();
    assert_eq!(texts(&t, &ids), ["a", "<tool>", "b"]);
    assert_eq!(t.token_kind(3), Some(TokenKind::UserDefined));

    // Specials next to each other and at the ends.
    let ids = t.encode("<|im_end|><|im_start|>", true).unwrap();
    assert_eq!(ids, [2, 1]);
}

#[test]
fn bos_is_added_when_the_vocabulary_asks() {
    let mut s = spec("smollm", &[]);
    s.add_bos = Some(true);
    let t = Tokenizer::from_spec(s).unwrap();
    assert!(t.adds_bos());
    assert_eq!(t.encode("hello", true).unwrap(), [1, t.token_id("hello").unwrap()]);
    assert_eq!(t.encode("hello", false).unwrap(), [t.token_id("hello").unwrap()]);
    let only_bos = EncodeOptions { add_special: true, parse_special: false };
    assert_eq!(t.encode_with("", only_bos).unwrap(), [1]);

    // Absent add_bos: llama-bpe adds it (as llama.cpp), smollm does not.
    let mut s = spec("llama-bpe", &[]);
    s.add_bos = None;
    assert!(Tokenizer::from_spec(s).unwrap().adds_bos());
    let mut s = spec("smollm", &[]);
    s.add_bos = None;
    assert!(!Tokenizer::from_spec(s).unwrap().adds_bos());
}

#[test]
fn end_of_generation_tokens() {
    let t = tok("smollm");
    assert_eq!(t.bos(), Some(1));
    assert_eq!(t.eos(), Some(2));
    // EOS, and <|endoftext|> by its text.
    assert_eq!(t.eog_ids(), [0, 2]);
    assert!(t.is_eog(0) && t.is_eog(2) && !t.is_eog(1));
}

#[test]
fn stream_decoder_never_emits_half_a_character() {
    let t = tok("smollm");
    for s in SAMPLES {
        let ids = t.encode(s, true).unwrap();
        let mut d = t.decoder();
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "{s:?}: {piece:?}");
            out.push_str(&piece);
        }
        assert!(!d.has_pending());
        assert_eq!(d.finish(), "");
        assert_eq!(&out, s);
    }

    // 😀 arrives as three tokens: nothing, nothing, then the whole emoji.
    let ids = t.encode("😀!", false).unwrap();
    let mut d = t.decoder();
    let pieces: Vec<String> = ids.iter().map(|&i| d.push(i).unwrap()).collect();
    assert_eq!(pieces, ["", "", "😀", "!"]);

    // A byte that can never start a character is U+FFFD at once; an
    // unfinished character left at the end is U+FFFD at finish.
    let cont = t.token_id("Ģ").unwrap(); // byte 0x80
    let lead = t.token_id("ðŁ").unwrap(); // F0 9F
    let mut d = t.decoder();
    assert_eq!(d.push(cont).unwrap(), "\u{FFFD}");
    assert_eq!(d.push(lead).unwrap(), "");
    assert!(d.has_pending());
    assert_eq!(d.finish(), "\u{FFFD}");

    // Skipping specials.
    let mut d = t.decoder().skip_special(true);
    assert_eq!(d.push(1).unwrap(), "");
    assert_eq!(d.push(t.token_id("hello").unwrap()).unwrap(), "hello");
    assert!(matches!(d.push(1_000_000), Err(TokenizerError::TokenOutOfRange { id: 1_000_000, .. })));
}

#[test]
fn chat_template_renders_chatml() {
    let t = tok("smollm");
    let messages = [ChatMessage::new("system", "You are terse."), ChatMessage::new("user", "What is 2+2?")];
    let text = t.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let without = t.apply_chat_template(&messages, false).unwrap();
    assert_eq!(without, text.strip_suffix("<|im_start|>assistant\n").unwrap());

    // No system message: the template's default one.
    let text = t.apply_chat_template(&[ChatMessage::new("user", "hi")], false).unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));

    // The rendered prompt tokenizes with its control tokens whole.
    let ids = t.encode(&text, true).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 2);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
    assert_eq!(t.decode(&ids).unwrap(), text);
}

#[test]
fn chat_template_variables_and_errors() {
    let mut s = spec("smollm", &[]);
    s.chat_template = Some(
        "{{ bos_token }}{% for m in messages %}{{ m.role | upper }}: {{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}{{ eos_token }}".into(),
    );
    let t = Tokenizer::from_spec(s).unwrap();
    let text = t.apply_chat_template(&[ChatMessage::new("user", "  hi  ")], true).unwrap();
    assert_eq!(text, "<|im_start|>USER: hi\nA:<|im_end|>");

    let mut s = spec("smollm", &[]);
    s.chat_template = Some("{{ raise_exception('no system role') }}".into());
    let err = Tokenizer::from_spec(s).unwrap().apply_chat_template(&[], false).unwrap_err();
    assert!(err.to_string().contains("no system role"), "{err}");
    assert!(!err.to_string().contains('\n'));

    let mut s = spec("smollm", &[]);
    s.chat_template = Some("{% for %}".into());
    let err = Tokenizer::from_spec(s).unwrap().apply_chat_template(&[], false).unwrap_err();
    assert!(matches!(err, TokenizerError::ChatTemplate(_)), "{err}");
    assert!(!err.to_string().contains('\n'));

    let mut s = spec("smollm", &[]);
    s.chat_template = None;
    let err = Tokenizer::from_spec(s).unwrap().apply_chat_template(&[], false).unwrap_err();
    assert!(matches!(err, TokenizerError::NoChatTemplate));

    // A template from a crafted file that would loop 10¹⁰ times (and write
    // 100 GB): refused when it runs out of instructions, not left to hang.
    let mut s = spec("smollm", &[]);
    s.chat_template =
        Some("{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}".into());
    let err = Tokenizer::from_spec(s).unwrap().apply_chat_template(&[], false).unwrap_err();
    assert!(matches!(err, TokenizerError::ChatTemplate(_)) && err.to_string().contains("out of fuel"), "{err}");
    // Templates that build gigabytes in a few instructions: a join of
    // many copies of a long string (its size is not charged to the fuel
    // with an empty joiner: it once asked for 5 GB and aborted), and a
    // string doubled again and again. Refused in one line.
    for (template, want) in [
        ("{% set a = 'x' * 5000000 %}{% set b = [a] * 1000 %}{{ b | join('') }}", "join would make a string"),
        ("{{ (['x' * 10000000] * 10000) | join }}", "join would make a string"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "out of fuel",
        ),
    ] {
        let mut s = spec("smollm", &[]);
        s.chat_template = Some(template.into());
        let err = Tokenizer::from_spec(s).unwrap().apply_chat_template(&[], false).unwrap_err();
        assert!(matches!(err, TokenizerError::ChatTemplate(_)) && err.to_string().contains(want), "{template}: {err}");
    }
    // A join of ordinary size still joins.
    let mut s = spec("smollm", &[]);
    s.chat_template = Some("{{ ['ab', 'cd', 3] | join('-') }}".into());
    assert_eq!(Tokenizer::from_spec(s).unwrap().apply_chat_template(&[], false).unwrap(), "ab-cd-3");
    // While the real template of a long conversation renders, and of a
    // message of a megabyte.
    let megabyte = "word ".repeat(200_000);
    let rendered = tok("smollm").apply_chat_template(&[ChatMessage::new("user", megabyte.as_str())], true).unwrap();
    assert!(rendered.contains(&megabyte));
    let t = tok("smollm");
    let long: Vec<ChatMessage> =
        (0..2000).map(|i| ChatMessage::new(["user", "assistant"][i % 2], "some words")).collect();
    assert!(t.apply_chat_template(&long, true).unwrap().len() > 2000 * 10);
}

/// Each bad vocabulary is refused with one line naming the problem.
#[test]
fn bad_vocabularies_are_one_line_errors() {
    let check = |s: VocabSpec, want: &str| {
        let err = Tokenizer::from_spec(s).unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
        assert!(!err.contains('\n'), "{err:?}");
    };
    check(spec("nonesuch", &[]), "unknown pre-tokenizer 'nonesuch'");
    // A SentencePiece vocabulary without its scores, or with too few.
    let mut s = spec("smollm", &[]);
    s.model = "llama".into();
    check(s.clone(), "a SentencePiece vocabulary needs its scores (tokenizer.ggml.scores)");
    s.scores = Some(vec![0.0; 3]);
    check(s, "3 scores for");
    let mut s = spec("smollm", &[]);
    s.model = "bert".into();
    check(s, "tokenizer model 'bert' is not supported");
    check(spec("smollm", &["hello"]), "duplicate token \"hello\"");
    let mut s = spec("smollm", &[]);
    s.merges.push("nospace".into());
    check(s, "is not two tokens");
    let mut s = spec("smollm", &[]);
    s.merges.push("q z".into());
    check(s, "merges");
    let mut s = spec("smollm", &["<0x-1>"]);
    s.token_types.as_mut().unwrap().pop();
    s.token_types.as_mut().unwrap().push(6);
    check(s, "byte token \"<0x-1>\" is not of the form <0xNN>");
    let mut s = spec("smollm", &[]);
    s.bos = Some(1 << 20);
    check(s, "BOS token id 1048576 is past the vocabulary");
    let mut s = spec("smollm", &[]);
    s.token_types.as_mut().unwrap().truncate(3);
    check(s, "3 token types for");
    let mut s = spec("smollm", &[]);
    s.bos = None;
    s.add_bos = Some(true);
    check(s, "no BOS token id");
    let t = tok("smollm");
    let err = t.decode(&[0, 9_999_999]).unwrap_err().to_string();
    assert!(err.contains("token id 9999999 is out of range"), "{err}");
}

#[test]
fn byte_tokens_decode_to_their_byte() {
    let mut s = spec("smollm", &["<0x0A>"]);
    let n = s.tokens.len();
    s.token_types.as_mut().unwrap()[n - 1] = 6;
    let t = Tokenizer::from_spec(s).unwrap();
    assert_eq!(t.token_bytes(n as u32 - 1), Some(&b"\n"[..]));
}

#[test]
fn bytes_without_a_token_are_dropped() {
    // SmolLM2's vocabulary has no token for byte 0x04 ('Ą'), among others.
    let mut s = spec("smollm", &[]);
    s.tokens.retain(|t| t != "Ą");
    s.token_types = None;
    let t = Tokenizer::from_spec(s).unwrap();
    let ids = t.encode("a\u{4}b", false).unwrap();
    assert_eq!(texts(&t, &ids), ["a", "b"]);
    // The byte stays in its word until the merges are done, so its
    // neighbours do not merge across it (llama.cpp's ids).
    assert_eq!(encode_texts(&t, "us"), ["us"]);
    assert_eq!(encode_texts(&t, "u\u{4}s"), ["u", "s"]);
}

#[test]
fn llama_cpps_end_of_generation_texts_are_control_tokens() {
    // "</s>" given as user-defined (Phi-3's file) or normal (Qwen 2's) is
    // an end-of-generation control token, as llama.cpp makes it: matched
    // whole only with special parsing.
    for kind in [1, 4] {
        let mut s = spec("smollm", &["</s>"]);
        *s.token_types.as_mut().unwrap().last_mut().unwrap() = kind;
        let t = Tokenizer::from_spec(s).unwrap();
        let id = t.token_id("</s>").unwrap();
        assert!(t.is_eog(id) && t.token_kind(id) == Some(TokenKind::Control));
        assert!(!t.encode_with("a</s>", EncodeOptions::default()).unwrap().contains(&id));
        let parsed = EncodeOptions { add_special: false, parse_special: true };
        assert!(t.encode_with("a</s>", parsed).unwrap().contains(&id));
    }
}

/// A small SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte
/// tokens, then pieces with their scores (higher merges first).
fn spm_spec(pieces: &[(&str, f32)]) -> VocabSpec {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut scores = vec![0.0; tokens.len()];
    for &(piece, score) in pieces {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    VocabSpec {
        model: "llama".into(),
        tokens,
        token_types: Some(types),
        scores: Some(scores),
        bos: Some(1),
        eos: Some(2),
        ..VocabSpec::default()
    }
}

#[test]
fn sentencepiece_merges_by_score_and_falls_back_to_bytes() {
    // "▁ab" can be reached as "▁a"+"b" or "▁"+"ab": the pair with the
    // higher score merges first ("ab", -1), then "▁"+"ab" (the only pair
    // left that is a token).
    let pieces = [("▁", -5.0), ("a", -3.0), ("b", -3.0), ("▁a", -2.0), ("ab", -1.0), ("▁ab", -4.0), ("c", -3.0)];
    let t = Tokenizer::from_spec(spm_spec(&pieces)).unwrap();
    let texts = |text: &str, options: EncodeOptions| -> Vec<String> {
        let ids = t.encode_with(text, options).unwrap();
        ids.iter().map(|&id| t.token_text(id).unwrap().to_string()).collect()
    };
    let plain = EncodeOptions::default();
    // The space in front of the text, spaces spelled as ▁.
    assert_eq!(texts("ab", plain), ["▁ab"]);
    assert_eq!(texts("ab c", plain), ["▁ab", "▁", "c"]);
    // Equal scores: the leftmost pair first ("b"+"c" is no token; "a"+"b"
    // is "ab", ahead of nothing else).
    assert_eq!(texts("cab", plain), ["▁", "c", "ab"]);
    // A character without a token is its UTF-8 bytes' tokens.
    assert_eq!(texts("é", plain), ["▁", "<0xC3>", "<0xA9>"]);
    // BOS with add_special (SentencePiece adds it by default), and the
    // decode drops the space spelled in front.
    let ids = t.encode("ab c", true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(t.decode_with(&ids[1..], true).unwrap(), "ab c");
    assert_eq!(t.decode_with(&t.encode("é ab", false).unwrap(), false).unwrap(), "é ab");
    // After a control token parsed whole, the next text gets its space
    // again (llama.cpp's is_prev_special).
    let special = EncodeOptions { add_special: false, parse_special: true };
    assert_eq!(texts("ab</s>ab", special), ["▁ab", "</s>", "▁ab"]);
    // Without the space prefix (tokenizer.ggml.add_space_prefix = false).
    let mut s = spm_spec(&pieces);
    s.add_space_prefix = Some(false);
    let t = Tokenizer::from_spec(s).unwrap();
    let ids = t.encode("ab ab", false).unwrap();
    let got: Vec<&str> = ids.iter().map(|&id| t.token_text(id).unwrap()).collect();
    assert_eq!(got, ["ab", "▁ab"]);
    assert_eq!(t.decode(&ids).unwrap(), "ab ab");
}
