//! Constant recipes are registered by ops: the registry reads them from a
//! file's `init`, the recipe sizes its data for the budget before making
//! it, and saving writes its fields back as they were.

use std::sync::Arc;

use kvjit_core::{Backend, DType, KernelKey, Tensor};
use kvjit_graph::{
    ArgSpec, ConstantInit, GraphBuilder, GraphError, OpDef, OpRegistry, ParamSpec, Params, RandomInit, Recipe,
    RecipeKind, TensorType, ValueDef, ValueType, graph_from_json, graph_from_json_within, graph_to_json,
};
use serde::{Deserialize, Serialize};

/// A test recipe: `start, start + by, …` over the constant's elements.
/// Its fields are declared out of alphabetical order and `by` is an f32,
/// so a save that sorted the fields or widened the float would show.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Ramp {
    ramp_start: f32,
    by: f32,
}

/// Bytes the ramp says it makes on top of its tensor (a scratch buffer,
/// say): the budget must count what the recipe reports.
const RAMP_SCRATCH: u64 = 1000;

impl Recipe for Ramp {
    const NAME: &'static str = "ramp";
    const MARKER: &'static str = "ramp_start";

    fn bytes(&self, ty: &TensorType) -> u64 {
        let elements: usize = ty.static_shape().unwrap().iter().product();
        (elements * ty.dtype.size_bytes()) as u64 + RAMP_SCRATCH
    }

    fn generate(&self, ty: &TensorType) -> kvjit_graph::Result<Tensor> {
        let shape = ty.static_shape().unwrap();
        let values: Vec<f32> = (0..shape.iter().product()).map(|i| self.ramp_start + i as f32 * self.by).collect();
        Ok(Tensor::from_f32(ty.dtype, &shape, &values)?)
    }
}

/// An op that brings `recipes` and does nothing else.
struct TableOp {
    name: &'static str,
    recipes: &'static [RecipeKind],
}

impl OpDef for TableOp {
    fn name(&self) -> &'static str {
        self.name
    }
    fn params(&self) -> &'static [ParamSpec] {
        &[]
    }
    fn inputs(&self) -> &'static [ArgSpec] {
        &[]
    }
    fn outputs(&self) -> &'static [&'static str] {
        &[]
    }
    fn infer(&self, _: &Params, _: &[&ValueType]) -> kvjit_graph::Result<Vec<TensorType>> {
        Ok(Vec::new())
    }
    fn kernel_key(&self, _: &Params, _: &[&ValueType], _: Backend) -> kvjit_graph::Result<KernelKey> {
        Err(GraphError::Unsupported("a test op has no kernels".into()))
    }
    fn recipes(&self) -> &'static [RecipeKind] {
        self.recipes
    }
}

const RAMP: &[RecipeKind] = &[RecipeKind::of::<Ramp>()];

fn with_ramp() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(TableOp { name: "table", recipes: RAMP })).unwrap();
    registry
}

/// A graph file of one `[2, 3]` f32 constant made by `init`.
fn file_with(init: &str) -> String {
    format!(
        r#"{{"format": "kvjit-graph", "version": 1, "name": "tables", "values": [
            {{"kind": "constant", "id": "v0", "name": "table", "dtype": "f32", "shape": [2, 3], "init": {init}}}],
            "nodes": []}}"#
    )
}

#[test]
fn a_recipe_an_op_registers_is_read_generated_and_saved_as_it_was() {
    let registry = with_ramp();
    let graph = graph_from_json(&file_with(r#"{"ramp_start": 1.0, "by": 0.1}"#), &registry, None).unwrap();
    let ValueDef::Constant { data, init: Some(init) } = &graph.values()[0].def else { panic!("a recipe constant") };
    assert_eq!(init.get::<Ramp>(), Some(&Ramp { ramp_start: 1.0, by: 0.1 }));
    let want: Vec<f32> = (0..6).map(|i| 1.0 + i as f32 * 0.1f32).collect();
    assert_eq!(data.to_f32_vec().unwrap(), want);
    // Saved as its fields, in declared order, the f32 as written.
    let saved = graph_to_json(&graph, None);
    assert!(saved.contains("\"init\": {\n        \"ramp_start\": 1.0,\n        \"by\": 0.1\n      }"), "{saved}");
    let again = graph_from_json(&saved, &registry, None).unwrap();
    assert_eq!(graph_to_json(&again, None), saved);
}

#[test]
fn a_registry_without_the_op_does_not_know_its_recipe() {
    // Read as the default recipe, which refuses a field it does not have,
    // and the message says why that recipe.
    let err = graph_from_json(&file_with(r#"{"ramp_start": 1.0, "by": 0.1}"#), &OpRegistry::new(), None).unwrap_err();
    assert!(matches!(err, GraphError::Json(_)), "{err:?}");
    assert!(err.to_string().contains("unknown field"), "{err}");
    let why = "(an \"init\" without the field that marks a registered recipe, \"seed\" (random), is read as random)";
    assert!(err.to_string().ends_with(why), "{err}");
    // The builder refuses it too: a graph it saved could not be loaded.
    let registry = OpRegistry::new();
    let mut b = GraphBuilder::new("tables", &registry);
    let err = b.recipe_constant("table", DType::F32, &[2, 3], Ramp { ramp_start: 0.0, by: 1.0 }.into()).unwrap_err();
    assert!(matches!(&err, GraphError::UnknownRecipe { name: "ramp", known } if known == "random"), "{err:?}");
    // With the op, it builds.
    let registry = with_ramp();
    let mut b = GraphBuilder::new("tables", &registry);
    b.recipe_constant("table", DType::F32, &[2, 3], Ramp { ramp_start: 0.0, by: 1.0 }.into()).unwrap();
}

#[test]
fn the_budget_counts_the_bytes_a_recipe_reports_before_it_is_made() {
    let registry = with_ramp();
    let text = file_with(r#"{"ramp_start": 1.0, "by": 0.1}"#);
    let bytes = 6 * 4 + RAMP_SCRATCH;
    graph_from_json_within(&text, &registry, None, bytes).unwrap();
    let err = graph_from_json_within(&text, &registry, None, bytes - 1).unwrap_err();
    assert!(
        matches!(&err, GraphError::RecipeBudget { name, bytes: b, .. } if name == "table" && *b == bytes),
        "{err:?}"
    );
}

#[test]
fn recipes_clashing_by_name_or_marker_are_refused_and_nothing_is_added() {
    #[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
    struct Seeded {
        seed: u64,
    }
    impl Recipe for Seeded {
        const NAME: &'static str = "seeded";
        const MARKER: &'static str = "seed";
        fn generate(&self, _: &TensorType) -> kvjit_graph::Result<Tensor> {
            unreachable!("never registered")
        }
    }
    const SEEDED: &[RecipeKind] = &[RecipeKind::of::<Seeded>()];
    let mut registry = with_ramp();
    let err = registry.register(Arc::new(TableOp { name: "again", recipes: RAMP })).unwrap_err();
    assert!(matches!(err, GraphError::DuplicateRecipe { name: "ramp", registered: "ramp", .. }), "{err:?}");
    // The built-in random recipe's marker is taken too.
    let err = registry.register(Arc::new(TableOp { name: "seeded", recipes: SEEDED })).unwrap_err();
    assert!(matches!(err, GraphError::DuplicateRecipe { marker: "seed", registered: "random", .. }), "{err:?}");
    assert!(registry.get("again").is_err() && registry.get("seeded").is_err(), "refused ops are not added");
    let names: Vec<&str> = registry.recipes().iter().map(|k| k.name()).collect();
    assert_eq!(names.iter().filter(|&&n| n == "ramp").count(), 1, "{names:?}");
}

#[test]
fn an_init_with_the_markers_of_two_recipes_is_refused() {
    let err = with_ramp().read_recipe(serde_json::json!({"seed": 1, "ramp_start": 1.0, "by": 1.0})).unwrap_err();
    assert!(matches!(err, GraphError::Json(_)), "{err:?}");
    assert!(err.to_string().contains("two recipes, random (\"seed\") and ramp (\"ramp_start\")"), "{err}");
    // One marker: that recipe, whose own checks name the stray field.
    let err = with_ramp().read_recipe(serde_json::json!({"ramp_start": 1.0, "by": 1.0, "low": 0.0})).unwrap_err();
    assert!(err.to_string().contains("unknown field `low`"), "{err}");
    let random = with_ramp().read_recipe(serde_json::json!({"seed": 1, "low": 0.0, "high": 1.0})).unwrap();
    assert_eq!(random, ConstantInit::from(RandomInit { seed: 1, low: 0.0, high: 1.0 }));
}

/// A recipe whose data cannot be made: any attempt to draw it fails.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Undrawable {
    undrawable: u32,
}

impl Recipe for Undrawable {
    const NAME: &'static str = "undrawable";
    const MARKER: &'static str = "undrawable";

    fn generate(&self, _: &TensorType) -> kvjit_graph::Result<Tensor> {
        Err(GraphError::Param { param: "init".into(), problem: "drawn".into() })
    }
}

/// A builder for a graph file declares recipe constants without drawing
/// them, writes the JSON a materialized graph writes, and refuses to hand
/// out a graph to run.
#[test]
fn a_graph_file_builder_never_draws_its_recipes_and_never_hands_out_a_graph() {
    const BOTH: &[RecipeKind] = &[RecipeKind::of::<Ramp>(), RecipeKind::of::<Undrawable>()];
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(TableOp { name: "table", recipes: BOTH })).unwrap();
    let ramp = ConstantInit::new(Ramp { ramp_start: 1.0, by: 0.5 });
    let undrawable = ConstantInit::new(Undrawable { undrawable: 7 });

    // Drawn: the undrawable recipe fails at once.
    let mut b = GraphBuilder::new("tables", &registry);
    let err = b.recipe_constant("u", DType::F32, &[2, 3], undrawable.clone()).unwrap_err();
    assert!(err.to_string().contains("drawn"), "{err}");

    let mut b = GraphBuilder::for_graph_file("tables", &registry);
    b.recipe_constant("t", DType::F32, &[2, 3], ramp.clone()).unwrap();
    b.recipe_constant("u", DType::BF16, &[4096, 4096], undrawable).unwrap();
    let text = b.finish_to_json().unwrap();
    assert!(text.contains("\"undrawable\": 7") && text.contains("\"ramp_start\": 1.0"), "{text}");

    // The ramp alone, both ways: the same file.
    let mut deferred = GraphBuilder::for_graph_file("tables", &registry);
    deferred.recipe_constant("t", DType::F32, &[2, 3], ramp.clone()).unwrap();
    let mut drawn = GraphBuilder::new("tables", &registry);
    drawn.recipe_constant("t", DType::F32, &[2, 3], ramp).unwrap();
    assert_eq!(deferred.finish_to_json().unwrap(), graph_to_json(&drawn.finish().unwrap(), None));

    let mut b = GraphBuilder::for_graph_file("tables", &registry);
    b.recipe_constant("t", DType::F32, &[2, 3], ConstantInit::new(Ramp { ramp_start: 0.0, by: 1.0 })).unwrap();
    let err = b.finish().unwrap_err();
    assert!(matches!(err, GraphError::DeferredRecipes { ref graph } if graph == "tables"), "{err}");
}
