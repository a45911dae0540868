//! The real SmolLM2 tokenizer and chat template, imported from its GGUF, produce the token ids of
//! docs/golden-outputs.md.

mod common;

use kvgate_protocol::prompt::{ChatMessage, PromptRenderer};

#[test]
fn chat_template_and_tokenizer_match_the_golden_ids() {
    let Some(dir) = common::smollm2_dir() else {
        return;
    };
    let r = PromptRenderer::from_dir(&dir).unwrap();
    let ids = r
        .encode_chat(&[ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }])
        .unwrap();
    assert_eq!(ids.len(), 37, "{ids:?}");
    assert_eq!(ids[..6], common::GOLDEN_CHAT_PROMPT_HEAD);
    assert_eq!(ids[31..], common::GOLDEN_CHAT_PROMPT_TAIL);
    assert_eq!(
        r.encode("The quick brown fox").unwrap(),
        common::GOLDEN_FOX_PROMPT
    );
    assert_eq!(
        r.decode(&common::GOLDEN_CHAT_ANSWER).unwrap(),
        "The capital of France is Paris."
    );
    assert_eq!(r.eos_token_id(), Some(2));
    // A system message replaces the default one.
    let text = r
        .render_chat(
            &[
                ChatMessage {
                    role: "system".into(),
                    content: "Be brief.".into(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "Hi".into(),
                },
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}
