//! Generation on token ids (`kvjit::generate`) over the tiny two-layer
//! model: decoding step by step on the paged cache picks what a fresh
//! prefill of the whole sequence would, prompts batched side by side
//! generate what each does alone, the sampler follows its distribution and
//! seed, and what cannot run is refused before anything does.

use kvjit::generate::{GenerateOptions, Generation, Model, Sampler, Sampling};
use kvjit::models::llama::{LlamaConfig, model_graph};
use kvjit::{CompileOptions, DeviceContextPtr, Executor, compile, standard_registry};

fn tiny_model() -> Model {
    let registry = standard_registry();
    let graph = model_graph(&LlamaConfig::tiny(), registry.ops()).unwrap();
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    Model::new(&graph, &registry, exe, Executor::new(DeviceContextPtr::cpu(2).unwrap())).unwrap()
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, sampling: Sampling::greedy(), stop: Vec::new(), keep_logits: true }
}

fn run(model: &Model, prompts: &[Vec<u32>], options: &GenerateOptions) -> Generation {
    let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let out = model.generate(prompts, options, &mut |p, t| streamed[p].push(t)).unwrap();
    assert_eq!(streamed, out.tokens, "every token is streamed as it is picked, in order");
    out
}

/// Largest |a − b| over the larger row's largest magnitude.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale
}

#[test]
fn decoding_on_the_cache_picks_what_a_fresh_prefill_of_the_whole_sequence_does() {
    let model = tiny_model();
    let prompt = vec![5u32, 17, 3, 88, 41, 9, 60];
    let out = run(&model, std::slice::from_ref(&prompt), &greedy(6));
    assert_eq!(out.tokens[0].len(), 6);
    assert_eq!(out.decode_steps, 5);
    for i in 0..6 {
        let mut sequence = prompt.clone();
        sequence.extend(&out.tokens[0][..i]);
        let fresh = run(&model, &[sequence], &greedy(1));
        assert_eq!(fresh.tokens[0][0], out.tokens[0][i], "token {i}");
        let error = relative_error(&out.logits[0][i], &fresh.logits[0][0]);
        assert!(error < 1e-4, "token {i}: logits differ by {error}");
        let scale = fresh.logits[0][0].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 1e-3, "the logits are not trivially small");
    }
}

#[test]
fn prompts_batched_side_by_side_generate_what_each_does_alone() {
    let model = tiny_model();
    let prompts = vec![vec![1u32, 2, 3, 4, 5, 6, 7, 8, 9], vec![70u32, 33], vec![12u32, 40, 95, 0]];
    let together = run(&model, &prompts, &greedy(5));
    for (p, prompt) in prompts.iter().enumerate() {
        let alone = run(&model, std::slice::from_ref(prompt), &greedy(5));
        assert_eq!(together.tokens[p], alone.tokens[0], "prompt {p}");
        for (i, (a, b)) in together.logits[p].iter().zip(&alone.logits[0]).enumerate() {
            let error = relative_error(a, b);
            assert!(error < 1e-4, "prompt {p}, token {i}: {error}");
        }
    }
}

#[test]
fn a_stop_token_ends_its_sequence_and_only_its_own() {
    let model = tiny_model();
    let prompts = vec![vec![1u32, 2, 3], vec![50u32, 51]];
    let free = run(&model, &prompts, &greedy(4));
    let stop = free.tokens[0][0];
    let stopped = run(&model, &prompts, &GenerateOptions { stop: vec![stop], ..greedy(4) });
    assert_eq!(stopped.tokens[0], vec![stop], "the stop token is kept and ends the sequence");
    let other_stops = free.tokens[1].iter().position(|&t| t == stop).map_or(4, |i| i + 1);
    assert_eq!(stopped.tokens[1], free.tokens[1][..other_stops], "the other sequence runs on");
}

#[test]
fn sampling_follows_its_distribution_and_seed() {
    // Probabilities 1/4 and 3/4 (and ~0 for the rest).
    let logits = [0.0f32, 3f32.ln(), -40.0, -40.0];
    let sampling = Sampling { temperature: 1.0, top_k: None, top_p: None, seed: 9 };
    let draws: Vec<u32> = {
        let mut sampler = Sampler::new(sampling);
        (0..4000).map(|_| sampler.pick(&logits)).collect()
    };
    let ones = draws.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
    assert!((ones - 0.75).abs() < 0.03, "token 1 drawn {ones} of the time");
    assert!(draws.iter().all(|&t| t < 2));
    let mut again = Sampler::new(sampling);
    assert!(draws.iter().all(|&t| t == again.pick(&logits)), "one seed, one sequence");
    let mut other = Sampler::new(Sampling { seed: 10, ..sampling });
    assert!(draws.iter().any(|&t| t != other.pick(&logits)), "another seed, another sequence");
    // top-k 1 and a top-p below the largest probability are greedy; a
    // temperature near 0 is too.
    for narrowed in [
        Sampling { top_k: Some(1), ..sampling },
        Sampling { top_p: Some(0.5), ..sampling },
        Sampling { temperature: 1e-3, ..sampling },
    ] {
        let mut sampler = Sampler::new(narrowed);
        assert!((0..200).all(|_| sampler.pick(&logits) == 1), "{narrowed:?}");
    }
    assert_eq!(Sampler::new(Sampling::greedy()).pick(&[1.0, 5.0, 5.0, -2.0]), 1, "greedy takes the lowest id on a tie");
}

#[test]
fn what_cannot_run_is_refused_in_one_line() {
    let model = tiny_model();
    let context = model.context_length();
    let refused = |prompts: &[Vec<u32>], options: &GenerateOptions| {
        model.generate(prompts, options, &mut |_, _| panic!("nothing runs")).unwrap_err().to_string()
    };
    assert!(refused(&[vec![1]], &greedy(0)).contains("--max-tokens must be at least 1"));
    assert!(refused(&[vec![]], &greedy(2)).contains("at least one token"));
    let long = vec![1u32; context];
    assert!(refused(&[long], &greedy(1)).contains(&format!("past the context length {context}")));
    let many = vec![vec![1u32; 8]; model.max_batch(context) + 1];
    assert!(refused(&many, &greedy(context - 8)).contains("cache pages"));
    let hot = GenerateOptions { sampling: Sampling { temperature: -1.0, ..Sampling::greedy() }, ..greedy(1) };
    assert!(refused(&[vec![1]], &hot).contains("--temperature"));
    let top_p = GenerateOptions { sampling: Sampling { top_p: Some(1.5), ..Sampling::greedy() }, ..greedy(1) };
    assert!(refused(&[vec![1]], &top_p).contains("--top-p"));
}
