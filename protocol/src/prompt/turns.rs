//! The chat template's fast path. Most chat templates render a conversation turn by turn: a
//! fixed head, the message's content, a fixed tail, per role, after a fixed start (which may hold
//! a default system prompt when the conversation has none), and a fixed generation prompt. For
//! such a template, rendering is string concatenation, which costs a fraction of running the
//! template (the gateway renders every chat request it routes).
//!
//! [`TurnTemplate::derive`] reads those pieces off the template's own output on probe
//! conversations with unique markers for contents, then checks the concatenation against the
//! template on many conversations: every role order up to seven turns, contents with padding,
//! newlines, template syntax, think tags and special tokens' spellings, with and without the
//! generation prompt. Any difference, or any conversation the template refuses, and the template
//! keeps running for every request. The fast path covers a first `system` message, then `user`
//! and `assistant` turns; any other conversation goes through the template.

use super::ChatMessage;

/// A turn-by-turn chat template, as pieces of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TurnTemplate {
    /// Before the first message's content when it is a system message, and after it.
    system: (String, String),
    /// Before the first turn when the conversation has no system message (a default system
    /// prompt, when the template has one).
    start_without_system: String,
    user: (String, String),
    assistant: (String, String),
    /// Appended for `add_generation_prompt`.
    generation: String,
}

const MARKERS: [&str; 3] = ["kvgateProbeQ7x", "kvgateProbeJ2m", "kvgateProbeZ9k"];

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.to_owned(),
        content: content.to_owned(),
    }
}

/// `text` split around the one occurrence of `marker`.
fn split_once_only<'a>(text: &'a str, marker: &str) -> Option<(&'a str, &'a str)> {
    let (head, tail) = text.split_once(marker)?;
    (!tail.contains(marker)).then_some((head, tail))
}

impl TurnTemplate {
    /// The template's pieces, when it is a turn-by-turn template; `render(messages,
    /// add_generation_prompt)` runs the template itself on contents already quoted by `quote`.
    pub(crate) fn derive<R, Q>(render: R, quote: Q) -> Option<TurnTemplate>
    where
        R: Fn(&[ChatMessage], bool) -> Option<String>,
        Q: Fn(&str) -> String,
    {
        let [a, b, c] = MARKERS;
        let r1 = render(&[msg("system", a)], false)?;
        let (system_head, system_tail) = split_once_only(&r1, a)?;
        let r2 = render(&[msg("system", a), msg("user", b)], false)?;
        let (user_head, user_tail) = split_once_only(r2.strip_prefix(r1.as_str())?, b)?;
        let r3 = render(
            &[msg("system", a), msg("user", b), msg("assistant", c)],
            false,
        )?;
        let (assistant_head, assistant_tail) = split_once_only(r3.strip_prefix(r2.as_str())?, c)?;
        let r4 = render(&[msg("user", b)], false)?;
        let start_without_system = r4.strip_suffix(&format!("{user_head}{b}{user_tail}"))?;
        let g = render(&[msg("system", a), msg("user", b)], true)?;
        let generation = g.strip_prefix(r2.as_str())?;
        let turns = TurnTemplate {
            system: (system_head.to_owned(), system_tail.to_owned()),
            start_without_system: start_without_system.to_owned(),
            user: (user_head.to_owned(), user_tail.to_owned()),
            assistant: (assistant_head.to_owned(), assistant_tail.to_owned()),
            generation: generation.to_owned(),
        };
        turns.agrees_with(&render, &quote).then_some(turns)
    }

    /// The conversation rendered, or `None` when it is not one the fast path covers.
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        quote: impl Fn(&str) -> String,
    ) -> Option<String> {
        let mut out = String::with_capacity(
            256 + messages.iter().map(|m| m.content.len() + 32).sum::<usize>(),
        );
        let rest = match messages.first()? {
            m if m.role == "system" => {
                out.push_str(&self.system.0);
                out.push_str(&quote(&m.content));
                out.push_str(&self.system.1);
                &messages[1..]
            }
            _ => {
                out.push_str(&self.start_without_system);
                messages
            }
        };
        for m in rest {
            let (head, tail) = match m.role.as_str() {
                "user" => &self.user,
                "assistant" => &self.assistant,
                _ => return None,
            };
            out.push_str(head);
            out.push_str(&quote(&m.content));
            out.push_str(tail);
        }
        if add_generation_prompt {
            out.push_str(&self.generation);
        }
        Some(out)
    }

    /// Whether the pieces reproduce the template on every probe conversation.
    fn agrees_with(
        &self,
        render: &impl Fn(&[ChatMessage], bool) -> Option<String>,
        quote: &impl Fn(&str) -> String,
    ) -> bool {
        const CONTENTS: [&str; 9] = [
            "hello",
            "  padded on both sides  ",
            "",
            "two\nlines\n",
            "<think>reasoning</think>the answer",
            "{{ not_a_variable }} {% raw %}",
            "<|im_start|>user\nforged<|im_end|>",
            "</s><s>[INST] <<SYS>>",
            "é ✓ 中文",
        ];
        let mut n = 0usize;
        for len in 1..=7usize {
            // Every sequence of roles of this length with an optional leading system message.
            for system in [false, true] {
                let turns = len - usize::from(system);
                for pattern in 0..(1usize << turns) {
                    let mut messages = Vec::with_capacity(len);
                    if system {
                        messages.push(msg("system", CONTENTS[n % CONTENTS.len()]));
                        n += 1;
                    }
                    for t in 0..turns {
                        let role = if pattern >> t & 1 == 0 {
                            "user"
                        } else {
                            "assistant"
                        };
                        messages.push(msg(role, CONTENTS[n % CONTENTS.len()]));
                        n += 1;
                    }
                    for generation in [false, true] {
                        match (
                            render(&messages, generation),
                            self.render(&messages, generation, quote),
                        ) {
                            (Some(want), Some(got)) if want == got => {}
                            _ => return false,
                        }
                    }
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::{context, Environment, Error, ErrorKind};

    /// `render` for `template`, as the renderer runs it (contents as given).
    fn renderer(template: &str) -> impl Fn(&[ChatMessage], bool) -> Option<String> + '_ {
        move |messages, generation| {
            let mut env = Environment::new();
            env.add_function("raise_exception", |m: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, m))
            });
            env.add_template("t", template).ok()?;
            let messages: Vec<_> = messages
                .iter()
                .map(|m| context! { role => m.role.clone(), content => m.content.clone() })
                .collect();
            env.get_template("t")
                .ok()?
                .render(context! { messages => messages, add_generation_prompt => generation })
                .ok()
        }
    }

    /// SmolLM2's template: ChatML with a default system prompt.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_with_a_default_system_prompt_is_derived_and_exact() {
        let render = renderer(SMOLLM2);
        let turns = TurnTemplate::derive(&render, str::to_owned).expect("a turn template");
        assert!(turns.start_without_system.contains("named SmolLM"));
        let conversation = [
            msg("system", "Be brief."),
            msg("user", "Hi"),
            msg("assistant", "Hello!"),
            msg("user", "What is 2+2?"),
        ];
        for generation in [false, true] {
            for from in 0..2 {
                assert_eq!(
                    turns.render(&conversation[from..], generation, str::to_owned),
                    render(&conversation[from..], generation)
                );
            }
        }
        // Not covered: the template runs instead.
        assert_eq!(turns.render(&[], true, str::to_owned), None);
        let tool = [msg("user", "x"), msg("tool", "{}")];
        assert_eq!(turns.render(&tool, true, str::to_owned), None);
        let late_system = [msg("user", "x"), msg("system", "y")];
        assert_eq!(turns.render(&late_system, true, str::to_owned), None);
    }

    #[test]
    fn templates_that_are_not_turn_by_turn_keep_running() {
        for template in [
            // Refuses some role orders (Llama 2 style).
            "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}",
            // Trims contents.
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</>{% endfor %}",
            // Drops the reasoning of earlier assistant turns (Qwen3 style).
            "{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' and '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}</>{% endfor %}",
            // Marks the last message.
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if loop.last %}<last>{% endif %}</>{% endfor %}",
            // Counts turns.
            "{% for m in messages %}{{ loop.index }}:{{ m['content'] }};{% endfor %}",
        ] {
            assert_eq!(
                TurnTemplate::derive(renderer(template), str::to_owned),
                None,
                "{template}"
            );
        }
    }
}
