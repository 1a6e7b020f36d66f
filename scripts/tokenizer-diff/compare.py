"""Compare kvjit's token ids (examples/tokenize_jsonl.rs) with llama.cpp's
(llama-cpp-python, vocab_only) for every string of a JSONL file, plain and
with special tokens parsed; shrink each mismatch to a minimal string.

    python compare.py KVJIT_BIN MODEL.gguf STRINGS.jsonl REPORT.json

Prints one summary line per mode; exits 1 when any string differs."""
import collections, json, subprocess, sys

import llama_cpp

binary, model, strings, report = sys.argv[1:5]
MAX_MINIMIZED = 40
llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)


def reference(s, special):
    try:
        return llm.tokenize(s.encode("utf-8", "surrogatepass"), add_bos=False, special=special)
    except Exception as e:  # a string llama.cpp refuses is a result too
        return "ERROR: %r" % e


lines = [json.loads(l) for l in open(strings, encoding="utf-8") if l.strip()]
batch = subprocess.run([binary, model, strings], capture_output=True, text=True, check=True).stdout.splitlines()
kvjit = [json.loads(l) for l in batch if l]
assert len(kvjit) == len(lines), "one result per string"
session = subprocess.Popen([binary, model, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


def kvjit_ids(s):
    session.stdin.write(json.dumps(s) + "\n")
    session.stdin.flush()
    return json.loads(session.stdout.readline())


def differs(s, mode):
    return kvjit_ids(s)[mode] != reference(s, mode == "special")


def minimize(s, mode):
    """Delta debugging over characters, then each character tried as 'a'."""
    chars, n = list(s), 2
    while chars:
        chunk, changed, i = max(1, len(chars) // n), False, 0
        while i < len(chars):
            candidate = chars[:i] + chars[i + chunk:]
            if differs("".join(candidate), mode):
                chars, changed = candidate, True
            else:
                i += chunk
        if not changed:
            if chunk == 1:
                break
            n = min(len(chars), n * 2)
    for i in range(len(chars)):
        if chars[i] != "a":
            candidate = chars[:i] + ["a"] + chars[i + 1:]
            if differs("".join(candidate), mode):
                chars = candidate
    return "".join(chars)


result, failed = {"model": model, "strings": len(lines), "modes": {}}, False
for mode in ("plain", "special"):
    bad = [(s, k[mode]) for s, k in zip(lines, kvjit) if k[mode] != reference(s, mode == "special")]
    classes = collections.OrderedDict()
    for s, _ in bad[:MAX_MINIMIZED]:
        m = minimize(s, mode)
        entry = classes.setdefault(m, {"minimal": m, "kvjit": kvjit_ids(m)[mode],
                                       "llama_cpp": reference(m, mode == "special"), "count": 0})
        entry["count"] += 1
    result["modes"][mode] = {"mismatches": len(bad), "classes": list(classes.values())}
    print(f"{mode}: {len(bad)} of {len(lines)} strings differ ({len(classes)} minimal classes)")
    failed |= bool(bad)
session.stdin.close()
session.wait()
json.dump(result, open(report, "w", encoding="utf-8"), ensure_ascii=False, indent=1)
sys.exit(1 if failed else 0)
