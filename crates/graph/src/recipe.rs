//! Constant recipes: data a graph makes instead of storing it.
//!
//! A constant may carry a recipe ([`ConstantInit`]) in place of its data:
//! graph files save the recipe, and the data is made when the graph is
//! built or loaded. This crate holds only the mechanism — the [`Recipe`]
//! trait a recipe's type implements, the [`RecipeKind`] an op registers
//! for it ([`OpDef::recipes`](crate::OpDef::recipes)), and the loader that
//! asks the registry ([`OpRegistry::read_recipe`](crate::OpRegistry::read_recipe)).
//! Its one built-in recipe is [`RandomInit`]: the weights of any op, and
//! what an `init` names when it names no registered recipe.
//!
//! In a file a recipe is its fields and nothing else (no tag):
//! `{"seed": 1, "low": -0.5, "high": 0.5}`, `{"rope_theta": 500000.0}`.
//! Each kind has a *marker*, a field no other registered kind has; an
//! `init` object is read as the kind whose marker it holds, or as
//! [`RandomInit`] when it holds none (so a misspelt field is refused by
//! name). Saving writes the recipe's own serialization, fields in the
//! order its type declares them (serde_json's `Value` would sort them, and
//! would widen an `f32` field to `f64`), so a file saves to the text it was
//! loaded from. The recipe behind [`ConstantInit`] is a trait object;
//! [`erased_serde`] is what lets it serialize.
//!
//! A recipe says how many bytes it makes ([`Recipe::bytes`]) before it
//! makes them, so a loader can refuse a file whose recipes exceed its
//! budget without generating anything.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use kvjit_core::Tensor;
use rand::SeedableRng;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{GraphError, Result, TensorType};

/// A kind of constant recipe: its fields (a serde struct, read and written
/// as the `init` object of a graph file's constant), its size, and the data
/// it makes. Register it through an op ([`RecipeKind::of`],
/// [`OpDef::recipes`](crate::OpDef::recipes)); wrap a value in a
/// [`ConstantInit`] to give it to a constant.
pub trait Recipe: Serialize + DeserializeOwned + fmt::Debug + PartialEq + Send + Sync + 'static {
    /// The recipe's name in messages (`"random"`, `"rope"`); unique in a
    /// registry.
    const NAME: &'static str;
    /// A required field of this recipe that no other registered recipe
    /// has: an `init` object holding it is read as this recipe.
    const MARKER: &'static str;

    /// Bytes the data for a constant of type `ty` takes, known before any
    /// is made (budgets are checked against it); `u64::MAX` when the size
    /// overflows. Default: the tensor's size.
    fn bytes(&self, ty: &TensorType) -> u64 {
        tensor_bytes(ty)
    }

    /// Make the data of a constant of type `ty` (a static shape), or say
    /// why this recipe cannot make it.
    fn generate(&self, ty: &TensorType) -> Result<Tensor>;
}

/// The bytes of a tensor of type `ty`: `u64::MAX` when the product
/// overflows or a dim is not static (over any budget).
fn tensor_bytes(ty: &TensorType) -> u64 {
    ty.shape
        .iter()
        .try_fold(ty.dtype.size_bytes() as u64, |acc, d| acc.checked_mul(d.as_static()? as u64))
        .unwrap_or(u64::MAX)
}

/// [`Recipe`] behind `dyn`: what [`ConstantInit`] needs of it.
trait DynRecipe: erased_serde::Serialize + fmt::Debug + Send + Sync {
    fn name(&self) -> &'static str;
    fn bytes(&self, ty: &TensorType) -> u64;
    fn generate(&self, ty: &TensorType) -> Result<Tensor>;
    fn as_any(&self) -> &dyn Any;
    fn same_as(&self, other: &dyn DynRecipe) -> bool;
}

erased_serde::serialize_trait_object!(DynRecipe);

impl<R: Recipe> DynRecipe for R {
    fn name(&self) -> &'static str {
        R::NAME
    }

    fn bytes(&self, ty: &TensorType) -> u64 {
        Recipe::bytes(self, ty)
    }

    fn generate(&self, ty: &TensorType) -> Result<Tensor> {
        Recipe::generate(self, ty)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn same_as(&self, other: &dyn DynRecipe) -> bool {
        other.as_any().downcast_ref::<R>() == Some(self)
    }
}

/// A recipe that makes a constant's data when the graph is built or loaded
/// (graph files save the recipe, not the data): any [`Recipe`], e.g. a
/// [`RandomInit`] or an op's own. Build one with `.into()`; read one from a
/// file's fields with [`OpRegistry::read_recipe`](crate::OpRegistry::read_recipe).
#[derive(Clone)]
pub struct ConstantInit(Arc<dyn DynRecipe>);

impl ConstantInit {
    /// Wrap a recipe.
    pub fn new(recipe: impl Recipe) -> Self {
        Self(Arc::new(recipe))
    }

    /// The recipe's [`Recipe::NAME`].
    pub fn name(&self) -> &'static str {
        self.0.name()
    }

    /// The recipe, if it is an `R`.
    pub fn get<R: Recipe>(&self) -> Option<&R> {
        self.0.as_any().downcast_ref()
    }

    /// Bytes the data for a constant of type `ty` takes ([`Recipe::bytes`]),
    /// known before any is made.
    pub fn bytes(&self, ty: &TensorType) -> u64 {
        self.0.bytes(ty)
    }

    /// Make the data for a constant of type `ty`.
    pub fn materialize(&self, ty: &TensorType) -> Result<Tensor> {
        self.0.generate(ty)
    }
}

impl<R: Recipe> From<R> for ConstantInit {
    fn from(recipe: R) -> Self {
        Self::new(recipe)
    }
}

impl PartialEq for ConstantInit {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_as(other.0.as_ref())
    }
}

impl fmt::Debug for ConstantInit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for ConstantInit {
    /// The recipe's fields, as a graph file's `init` holds them.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        Serialize::serialize(self.0.as_ref(), serializer)
    }
}

/// A [`Recipe`] type as a registry holds it: its name, its marker field,
/// and how to read it from a file's `init` object. Ops list theirs in
/// [`OpDef::recipes`](crate::OpDef::recipes).
#[derive(Clone, Copy)]
pub struct RecipeKind {
    name: &'static str,
    marker: &'static str,
    read: fn(serde_json::Value) -> serde_json::Result<ConstantInit>,
}

impl RecipeKind {
    /// The kind of recipe `R`.
    pub const fn of<R: Recipe>() -> Self {
        Self { name: R::NAME, marker: R::MARKER, read: read_as::<R> }
    }

    /// [`Recipe::NAME`].
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// [`Recipe::MARKER`].
    pub fn marker(&self) -> &'static str {
        self.marker
    }

    /// Read a recipe of this kind from a file's `init` object; unknown and
    /// missing fields are refused by name.
    pub fn read(&self, fields: serde_json::Value) -> serde_json::Result<ConstantInit> {
        (self.read)(fields)
    }
}

fn read_as<R: Recipe>(fields: serde_json::Value) -> serde_json::Result<ConstantInit> {
    serde_json::from_value::<R>(fields).map(ConstantInit::new)
}

impl fmt::Debug for RecipeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecipeKind").field("name", &self.name).field("marker", &self.marker).finish()
    }
}

/// Deterministic random contents for a constant, for example graphs and
/// benchmarks that need realistic weights without shipping them: uniform in
/// `[low, high)` from a seeded generator. Every registry knows it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomInit {
    /// Generator seed.
    pub seed: u64,
    /// Lower bound (inclusive).
    pub low: f32,
    /// Upper bound (exclusive).
    pub high: f32,
}

impl Recipe for RandomInit {
    const NAME: &'static str = "random";
    const MARKER: &'static str = "seed";

    fn generate(&self, ty: &TensorType) -> Result<Tensor> {
        let shape = ty.static_shape().ok_or_else(|| GraphError::InputType {
            arg: "constant".into(),
            expected: "a fully static shape".into(),
            got: ty.to_string(),
        })?;
        if !(self.low < self.high && (self.high - self.low).is_finite()) {
            return Err(GraphError::Param {
                param: "init".into(),
                problem: format!("needs finite low < high with a finite width, got [{}, {})", self.low, self.high),
            });
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed);
        Ok(Tensor::random(ty.dtype, &shape, &mut rng, self.low, self.high)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvjit_core::DType;

    #[test]
    fn random_recipes_keep_their_json_form() {
        let text = r#"{"seed":1,"low":-0.5,"high":0.1}"#;
        let init = RecipeKind::of::<RandomInit>().read(serde_json::from_str(text).unwrap()).unwrap();
        assert_eq!(init.get::<RandomInit>(), Some(&RandomInit { seed: 1, low: -0.5, high: 0.1 }));
        assert_eq!(init, RandomInit { seed: 1, low: -0.5, high: 0.1 }.into());
        assert_ne!(init, RandomInit { seed: 2, low: -0.5, high: 0.1 }.into());
        // Fields in declared order, the f32 written as an f32 (0.1, not
        // 0.10000000149011612).
        assert_eq!(serde_json::to_string(&init).unwrap(), text);
    }

    #[test]
    fn a_recipe_is_sized_before_it_is_generated() {
        let init = ConstantInit::new(RandomInit { seed: 3, low: -1.0, high: 1.0 });
        let ty = TensorType::new(DType::BF16, [3.into(), 5.into()]);
        assert_eq!(init.bytes(&ty), 30);
        let data = init.materialize(&ty).unwrap();
        assert_eq!((data.dtype(), data.shape()), (DType::BF16, &[3, 5][..]));
        let huge = TensorType::new(DType::F32, [(usize::MAX / 2).into(), 4.into()]);
        assert_eq!(init.bytes(&huge), u64::MAX, "an overflowing size is over any budget");
    }
}
