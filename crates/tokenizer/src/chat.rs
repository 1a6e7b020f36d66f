//! The chat template (`tokenizer.chat_template`), rendered with `minijinja`
//! the way Hugging Face's `apply_chat_template` renders it: `trim_blocks`
//! and `lstrip_blocks` on, Python string methods (`.strip()`, `.startswith()`
//! …) through `minijinja-contrib`'s pycompat, and `raise_exception`.

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::{Result, TokenizerError};

/// One message of a conversation: `role` is `system`, `user` or `assistant`
/// (whatever the template knows).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// The work a rendering may do, in minijinja's fuel: one per instruction
/// and one per 64 bytes of data made. Real chat templates take a few
/// hundred instructions per message; a loop of 10¹⁰ or a string doubled
/// again and again (a crafted file's) runs out, having made at most 64 MB.
const TEMPLATE_FUEL: u64 = 1_000_000;

/// The longest string `join` may make. minijinja charges a join's output
/// to the fuel only when its joiner is not empty, so `['x' * 10⁷] * 10⁴ |
/// join` would ask for 100 GB at once (the process aborts on a failed
/// allocation): the size is checked first.
const MAX_JOINED_BYTES: usize = 64 << 20;

/// minijinja's `join`, refused when its result would pass
/// [`MAX_JOINED_BYTES`] (items that are not strings counted by their
/// display).
fn bounded_join(
    state: &mut minijinja::State,
    value: &Value,
    joiner: Option<minijinja::value::StringInput<'_>>,
    attribute: Option<&str>,
    kwargs: minijinja::value::Kwargs,
) -> Result<Value, Error> {
    let separator = joiner.as_ref().map_or(0, |j| j.as_str().len());
    let mut total = 0usize;
    for item in value.try_iter()? {
        let len = item.as_str().map_or_else(|| item.to_string().len(), str::len);
        total = total.saturating_add(len).saturating_add(separator);
        if total > MAX_JOINED_BYTES {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("join would make a string of more than {MAX_JOINED_BYTES} bytes"),
            ));
        }
    }
    minijinja::filters::join(state, value, joiner, attribute, kwargs)
}

/// Renders `template` for `messages`, within [`TEMPLATE_FUEL`] and
/// [`MAX_JOINED_BYTES`].
pub(crate) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid"),
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // The template comes from the model file: a crafted one must not loop
    // or grow without end.
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.add_filter("join", bounded_join);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    let one_line = |e: Error| TokenizerError::ChatTemplate(e.to_string().replace('\n', " "));
    let tmpl = env.template_from_str(template).map_err(one_line)?;
    tmpl.render(context! {
        messages => messages
            .iter()
            .map(|m| Value::from_pairs([("role", m.role.as_str()), ("content", m.content.as_str())]))
            .collect::<Value>(),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(one_line)
}
