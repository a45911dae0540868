//! A tokenizer-free token count for workload lengths, used when no tokenizer.json is given.
//!
//! It splits text like GPT-2's byte-level pre-tokenizer (contractions, words with one leading
//! space, single digits, punctuation runs, whitespace) and charges each piece what byte-level BPE
//! typically spends on it: one token for an ASCII word of up to 7 letters and one per 6 letters
//! beyond, about one per 2.2 bytes of non-ASCII letters, one per 3 bytes of punctuation. On the
//! ShareGPT file with vLLM's filter it gives 9,717 pairs (SmolLM2's tokenizer: 9,813), prompt mean
//! 109.7 / p50 30 / p99 923 tokens (110 / 30 / 916) and output mean 320 / p50 289 / p99 927
//! (300 / 266 / 919): outputs read about 7% long. O(text length).

/// Approximate token count of `text`.
pub fn approx_token_count(text: &str) -> usize {
    let chars: Vec<char> = text.chars().collect();
    let mut n = 0;
    let mut i = 0;
    while i < chars.len() {
        let (len, cost) = piece(&chars[i..]);
        n += cost;
        i += len.max(1);
    }
    n
}

/// Length in chars and token cost of the pre-token at the start of `s`.
fn piece(s: &[char]) -> (usize, usize) {
    const CONTRACTIONS: [&str; 7] = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"];
    for c in CONTRACTIONS {
        if c.chars().zip(s).all(|(a, b)| a == *b) && s.len() >= c.len() {
            return (c.len(), 1);
        }
    }
    let lead = usize::from(s[0] == ' ' && s.len() > 1 && !s[1].is_whitespace());
    let body = &s[lead..];
    let c = body[0];
    if c.is_alphabetic() {
        let run = body.iter().take_while(|c| c.is_alphabetic()).count();
        let word = &body[..run];
        let cost = if word.iter().all(char::is_ascii) {
            if run <= 7 {
                1
            } else {
                run.div_ceil(6)
            }
        } else {
            let bytes: usize = word.iter().map(|c| c.len_utf8()).sum();
            ((bytes as f64 / 2.2) as usize).max(1)
        };
        return (lead + run, cost);
    }
    if c.is_numeric() {
        return (lead + 1, 1);
    }
    if c.is_whitespace() {
        let run = s.iter().take_while(|c| c.is_whitespace()).count();
        // A run followed by text leaves its last space to the next word.
        let len = if run > 1 && run < s.len() && s[run - 1] == ' ' {
            run - 1
        } else {
            run
        };
        return (len, 1);
    }
    let run = body
        .iter()
        .take_while(|c| !c.is_whitespace() && !c.is_alphanumeric())
        .count();
    let bytes: usize = body[..run].iter().map(|c| c.len_utf8()).sum();
    (lead + run, bytes.div_ceil(3).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_pieces_like_byte_level_bpe() {
        assert_eq!(approx_token_count("The quick brown fox"), 4);
        assert_eq!(approx_token_count("What is the capital of France?"), 7);
        assert_eq!(approx_token_count("I'll pay 2024 dollars"), 8);
        assert_eq!(approx_token_count("internationalization"), 4);
        assert_eq!(approx_token_count(""), 0);
        assert_eq!(approx_token_count("a\n\nb"), 3);
    }
}
