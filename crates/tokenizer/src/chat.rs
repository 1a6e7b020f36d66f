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

/// Renders `template` for `messages`.
/// Template instructions a rendering may run: real chat templates take a
/// few hundred per message; a loop of 10¹⁰ (a crafted file's) runs out.
const TEMPLATE_FUEL: u64 = 10_000_000;

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
