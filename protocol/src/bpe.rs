//! A fast byte-level BPE encoder, for the `tokenizer.json` configurations it reproduces exactly.
//!
//! The Hugging Face `tokenizers` crate costs about 1 us per token plus about 10 us per call; this
//! encoder gives the same ids in a fraction of that, so the gateway can tokenize a request on its
//! routing path. It covers the GPT-2 family of tokenizers (SmolLM2's among them):
//!
//! - model `BPE`: no dropout, no unknown token, no byte fallback, no subword prefix or suffix,
//!   `ignore_merges: false`;
//! - no normalizer, no truncation, no padding; post-processor none or `ByteLevel` (which changes no
//!   ids);
//! - pre-tokenizer `ByteLevel { add_prefix_space: false, use_regex: true }`, alone or after
//!   `Digits { individual_digits: true }`;
//! - added tokens that are neither normalized nor stripped nor single-word (split out first,
//!   leftmost-longest, as `tokenizers` does with its Aho-Corasick automaton: [`AddedTokens`]).
//!
//! [`BpeEncoder::from_json`] answers `None` for anything else, and callers keep `tokenizers`.
//!
//! The pieces, each as in `tokenizers`:
//!
//! 1. Added tokens are split out of the text.
//! 2. `Digits`: every char for which `char::is_numeric` holds is a piece of its own (`tokenizers`
//!    calls that very function).
//! 3. `ByteLevel`'s GPT-2 pattern
//!    `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, applied to each
//!    remaining piece, hand-written as a scanner. `\p{L}`, `\p{N}` and `\s` are the regex crate's
//!    classes: their ranges are read from `regex-syntax`, the crate (and version) that compiles
//!    the pattern inside `tokenizers`, so the Unicode tables are the same ones.
//! 4. Each word's bytes start as one symbol each (GPT-2's byte-to-unicode map) and are merged by
//!    rank, lowest first and leftmost on a tie, exactly as `tokenizers`' `Word::merge_all` does.
//!
//! [`BpeEncoder::encode_quoted_into`] also reads a quote char that turns a special token's
//! spelling into plain text, the way prompts mark text that must not become control tokens
//! (see `crate::prompt`), in the same single scan.
//!
//! Words of up to [`MAX_CACHED_WORD`] bytes are cached per thread (the gateway encodes from many
//! tasks; a thread-local cache needs no lock).

mod added;

pub use added::{AddedMatch, AddedTokens, Stops};

use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Longest word (in bytes) kept in the per-thread cache.
pub const MAX_CACHED_WORD: usize = 48;
/// Words kept per thread and encoder; past it the cache starts over.
const MAX_CACHED_WORDS: usize = 16_384;
/// Encoders whose caches a thread keeps.
const MAX_CACHES_PER_THREAD: usize = 4;

/// A byte with no symbol in the vocabulary.
const MISSING: u32 = u32::MAX;

/// Character classes of the GPT-2 pattern.
const OTHER: u8 = 0;
const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const SPACE: u8 = 3;

/// A byte-level BPE tokenizer equivalent to `tokenizers` for the configurations listed in the
/// module's documentation.
pub struct BpeEncoder {
    /// Identifies this encoder's per-thread caches.
    id: u64,
    /// Id of each byte's symbol; [`MISSING`] for a byte whose symbol is not in the vocabulary
    /// (`tokenizers`, with no unknown token, drops it).
    byte_ids: [u32; 256],
    /// (left id, right id) -> (rank, merged id).
    merges: HashMap<u64, (u32, u32), FastHash>,
    added: AddedTokens,
    /// The added tokens' first bytes.
    stops: Stops,
    /// `Digits { individual_digits: true }` runs first.
    split_digits: bool,
    classes: &'static CharClasses,
}

impl std::fmt::Debug for BpeEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpeEncoder")
            .field("merges", &self.merges.len())
            .field("added_tokens", &self.added)
            .field("split_digits", &self.split_digits)
            .finish()
    }
}

fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (u32::from('!')..=u32::from('~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        map[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    map
}

fn is_null_or(v: Option<&serde_json::Value>, ok: impl Fn(&serde_json::Value) -> bool) -> bool {
    match v {
        None | Some(serde_json::Value::Null) => true,
        Some(v) => ok(v),
    }
}

fn is_byte_level(v: &serde_json::Value) -> bool {
    v.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
        && v.get("add_prefix_space").and_then(|b| b.as_bool()) == Some(false)
        && v.get("use_regex").and_then(|b| b.as_bool()) != Some(false)
}

fn is_individual_digits(v: &serde_json::Value) -> bool {
    v.get("type").and_then(|t| t.as_str()) == Some("Digits")
        && v.get("individual_digits").and_then(|b| b.as_bool()) == Some(true)
}

impl BpeEncoder {
    /// Builds the encoder from a parsed `tokenizer.json`, or `None` where this encoder could give
    /// other ids than `tokenizers` (any configuration not listed in the module's documentation).
    pub fn from_json(json: &serde_json::Value) -> Option<Self> {
        if !is_null_or(json.get("normalizer"), |_| false)
            || !is_null_or(json.get("truncation"), |_| false)
            || !is_null_or(json.get("padding"), |_| false)
            || !is_null_or(json.get("post_processor"), |p| {
                p.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
            })
        {
            return None;
        }
        let pre = json.get("pre_tokenizer")?;
        let split_digits = if is_byte_level(pre) {
            false
        } else if pre.get("type").and_then(|t| t.as_str()) == Some("Sequence") {
            match pre.get("pretokenizers")?.as_array()?.as_slice() {
                [d, b] if is_individual_digits(d) && is_byte_level(b) => true,
                _ => return None,
            }
        } else {
            return None;
        };

        let model = json.get("model")?;
        let empty_str = |v: &serde_json::Value| v.as_str() == Some("");
        if model.get("type").and_then(|t| t.as_str()) != Some("BPE")
            || !is_null_or(model.get("dropout"), |_| false)
            || !is_null_or(model.get("unk_token"), |_| false)
            || !is_null_or(model.get("continuing_subword_prefix"), empty_str)
            || !is_null_or(model.get("end_of_word_suffix"), empty_str)
            || !is_null_or(model.get("byte_fallback"), |b| b.as_bool() == Some(false))
            || !is_null_or(model.get("ignore_merges"), |b| b.as_bool() == Some(false))
        {
            return None;
        }
        let vocab: HashMap<&str, u32> = model
            .get("vocab")?
            .as_object()?
            .iter()
            .map(|(k, v)| Some((k.as_str(), u32::try_from(v.as_u64()?).ok()?)))
            .collect::<Option<_>>()?;

        let chars = bytes_to_unicode();
        let mut byte_ids = [MISSING; 256];
        for (b, c) in chars.iter().enumerate() {
            if let Some(&id) = vocab.get(c.encode_utf8(&mut [0; 4]) as &str) {
                byte_ids[b] = id;
            }
        }

        let list = model.get("merges")?.as_array()?;
        let mut merges = HashMap::with_capacity_and_hasher(list.len(), FastHash::default());
        for (rank, m) in list.iter().enumerate() {
            let (a, b) = match m {
                serde_json::Value::String(s) => s.split_once(' ')?,
                serde_json::Value::Array(p) if p.len() == 2 => (p[0].as_str()?, p[1].as_str()?),
                _ => return None,
            };
            let (ia, ib) = (*vocab.get(a)?, *vocab.get(b)?);
            let merged = *vocab.get(format!("{a}{b}").as_str())?;
            // As in `tokenizers`: a repeated pair keeps its last rank.
            merges.insert(pair(ia, ib), (u32::try_from(rank).ok()?, merged));
        }

        let mut tokens = Vec::new();
        for t in json.get("added_tokens")?.as_array()? {
            let flag = |k: &str| t.get(k).and_then(|v| v.as_bool());
            if flag("single_word") != Some(false)
                || flag("lstrip") != Some(false)
                || flag("rstrip") != Some(false)
                || flag("normalized") != Some(false)
            {
                return None;
            }
            let content = t.get("content")?.as_str()?;
            if content.is_empty() {
                return None;
            }
            let id = u32::try_from(t.get("id")?.as_u64()?).ok()?;
            // `tokenizers` reads a missing flag as false.
            tokens.push((content, id, flag("special") == Some(true)));
        }
        let added = AddedTokens::new(tokens);

        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Some(BpeEncoder {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            byte_ids,
            merges,
            stops: added.stops(),
            added,
            split_digits,
            classes: CharClasses::get()?,
        })
    }

    /// Token ids of `text`, as `tokenizers`' `encode(text, false)` gives them.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, &mut out);
        out
    }

    /// Appends the token ids of `text` to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        self.scan(text, None, out);
    }

    /// The added tokens, as this encoder splits them out.
    pub fn added_tokens(&self) -> &AddedTokens {
        &self.added
    }

    /// Appends the token ids of `text`, in which `quote` marks literal text: followed by a
    /// special token's spelling, the quote makes that spelling plain text, encoded with the text
    /// around it as `tokenizers` encodes a special token's spelling under `split_special_tokens`;
    /// doubled, it stands for itself once. Any other quote is an ordinary char. The quotes are
    /// read in the same scan that splits out the added tokens, so plain text costs no more.
    pub fn encode_quoted_into(&self, text: &str, quote: char, out: &mut Vec<u32>) {
        let mut buf = [0; 4];
        self.scan(text, Some(quote.encode_utf8(&mut buf).as_bytes()), out);
    }

    /// Token ids of `text`, read as [`BpeEncoder::encode_quoted_into`] reads it.
    pub fn encode_quoted(&self, text: &str, quote: char) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_quoted_into(text, quote, &mut out);
        out
    }

    /// Splits out the added tokens, and with `quote` the quoted spellings, encoding the text
    /// between them as plain text.
    fn scan(&self, text: &str, quote: Option<&[u8]>, out: &mut Vec<u32>) {
        let stops = match quote {
            Some(q) => self.stops.with(q[0]),
            None => self.stops,
        };
        with_cache(self.id, |cache| {
            let bytes = text.as_bytes();
            // Plain text taken out of quotes, to be encoded with the text that follows it;
            // it allocates only when a quote is met.
            let mut plain = String::new();
            let mut start = 0;
            let mut i = stops.next(bytes, 0);
            while i < bytes.len() {
                if let Some(q) = quote.filter(|q| bytes[i..].starts_with(q)) {
                    let at = i + q.len();
                    let len = if bytes[at..].starts_with(q) {
                        q.len()
                    } else {
                        match self.added.at(&bytes[at..]) {
                            Some(m) if m.special => m.len,
                            _ => 0,
                        }
                    };
                    if len > 0 {
                        plain.push_str(&text[start..i]);
                        plain.push_str(&text[at..at + len]);
                        start = at + len;
                    }
                    i = stops.next(bytes, at + len);
                    continue;
                }
                if let Some(m) = self.added.at(&bytes[i..]) {
                    self.plain(&mut plain, &text[start..i], out, cache);
                    out.push(m.id);
                    start = i + m.len;
                    i = stops.next(bytes, start);
                    continue;
                }
                i = stops.next(bytes, i + 1);
            }
            self.plain(&mut plain, &text[start..], out, cache);
        });
    }

    /// Encodes the plain text gathered from quotes followed by `rest`.
    fn plain(&self, gathered: &mut String, rest: &str, out: &mut Vec<u32>, cache: &mut WordCache) {
        if gathered.is_empty() {
            self.segment(rest, out, cache);
        } else {
            gathered.push_str(rest);
            self.segment(gathered, out, cache);
            gathered.clear();
        }
    }

    /// Class of the char at byte `i` of `s`, and its length.
    #[inline]
    fn class_at(&self, s: &str, i: usize) -> (u8, usize) {
        let b = s.as_bytes()[i];
        if b < 0x80 {
            return (ASCII_CLASS[b as usize], 1);
        }
        let c = s[i..].chars().next().unwrap_or('\0');
        (self.classes.of(c), c.len_utf8())
    }

    /// Text with no added token in it: digits split out, then the GPT-2 pattern.
    fn segment(&self, s: &str, out: &mut Vec<u32>, cache: &mut WordCache) {
        if !self.split_digits {
            self.pattern(s, 0, s.len(), out, cache);
            return;
        }
        let b = s.as_bytes();
        let mut start = 0;
        let mut i = 0;
        while i < b.len() {
            let (numeric, len) = if b[i] < 0x80 {
                (b[i].is_ascii_digit(), 1)
            } else {
                let c = s[i..].chars().next().unwrap_or('\0');
                (c.is_numeric(), c.len_utf8())
            };
            if numeric {
                self.pattern(s, start, i, out, cache);
                self.word(&b[i..i + len], out, cache);
                start = i + len;
            }
            i += len;
        }
        self.pattern(s, start, b.len(), out, cache);
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` over
    /// `s[start..end]`, each match encoded as a word.
    fn pattern(
        &self,
        s: &str,
        start: usize,
        end: usize,
        out: &mut Vec<u32>,
        cache: &mut WordCache,
    ) {
        let b = s.as_bytes();
        let mut i = start;
        while i < end {
            let stop = self.match_at(s, i, end);
            self.word(&b[i..stop], out, cache);
            i = stop;
        }
    }

    /// End of the pattern's match starting at `i` (there is always one, never empty).
    #[inline]
    fn match_at(&self, s: &str, i: usize, end: usize) -> usize {
        let b = &s.as_bytes()[..end];
        if b[i] == b'\'' {
            match (b.get(i + 1), b.get(i + 2)) {
                (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
                (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return i + 3,
                _ => {}
            }
        }
        let (class, len) = self.class_at(s, i);
        let (class, from) = if b[i] == b' ' && i + 1 < end {
            match self.class_at(s, i + 1) {
                (SPACE, _) => (SPACE, i),
                (c, l) => (c, i + 1 + l),
            }
        } else {
            (class, i + len)
        };
        if class != SPACE {
            // ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`: one class, as far as it goes.
            let mut j = from;
            while j < end {
                let (c, l) = self.class_at(s, j);
                if c != class {
                    break;
                }
                j += l;
            }
            return j;
        }
        // A run of whitespace: `\s+(?!\S)` leaves its last char to the next match when a
        // non-space follows, unless the run is that one char (then `\s+` takes it).
        let mut j = i;
        let mut last = i;
        while j < end {
            let (c, l) = self.class_at(s, j);
            if c != SPACE {
                break;
            }
            last = j;
            j += l;
        }
        if j == end || last == i {
            j
        } else {
            last
        }
    }

    /// One pre-tokenized word: cached ids, or BPE.
    #[inline]
    fn word(&self, w: &[u8], out: &mut Vec<u32>, cache: &mut WordCache) {
        if let [b] = w {
            let id = self.byte_ids[*b as usize];
            if id != MISSING {
                out.push(id);
            }
            return;
        }
        if w.len() > MAX_CACHED_WORD {
            self.bpe(w, out);
            return;
        }
        if let Some(ids) = cache.words.get(w) {
            out.extend_from_slice(ids);
            return;
        }
        let at = out.len();
        self.bpe(w, out);
        if cache.words.len() >= MAX_CACHED_WORDS {
            cache.words.clear();
        }
        cache.words.insert(w.into(), out[at..].into());
    }

    /// Byte-level BPE of one word, as `tokenizers`' `Word::merge_all`: a heap of candidate merges
    /// ordered by (rank, position); a popped merge applies when its pair is still there. Bytes
    /// with no symbol are left out first, as `tokenizers` leaves them out.
    fn bpe(&self, w: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        #[derive(Clone, Copy)]
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(w.len());
        for &b in w {
            let id = self.byte_ids[b as usize];
            if id != MISSING {
                let i = syms.len();
                syms.push(Sym {
                    id,
                    prev: i.wrapping_sub(1),
                    next: i + 1,
                    alive: true,
                });
            }
        }
        let n = syms.len();
        match syms.last_mut() {
            Some(last) => last.next = NONE,
            None => return,
        }
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            if let Some(&(rank, id)) = self.merges.get(&pair(syms[i].id, syms[i + 1].id)) {
                heap.push(std::cmp::Reverse((rank, i, id)));
            }
        }
        while let Some(std::cmp::Reverse((_, pos, new_id))) = heap.pop() {
            let cur = syms[pos];
            if !cur.alive || cur.next == NONE {
                continue;
            }
            let right = syms[cur.next];
            match self.merges.get(&pair(cur.id, right.id)) {
                Some(&(_, id)) if id == new_id => {}
                _ => continue,
            }
            syms[cur.next].alive = false;
            syms[pos].id = new_id;
            syms[pos].next = right.next;
            if right.next != NONE {
                syms[right.next].prev = pos;
            }
            if cur.prev != NONE {
                if let Some(&(rank, id)) = self.merges.get(&pair(syms[cur.prev].id, new_id)) {
                    heap.push(std::cmp::Reverse((rank, cur.prev, id)));
                }
            }
            if right.next != NONE {
                if let Some(&(rank, id)) = self.merges.get(&pair(new_id, syms[right.next].id)) {
                    heap.push(std::cmp::Reverse((rank, pos, id)));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(syms[i].id);
            i = syms[i].next;
        }
    }
}

#[inline]
fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// Classes of the ASCII chars, as the regex crate sees them.
const ASCII_CLASS: [u8; 128] = {
    let mut t = [OTHER; 128];
    let mut i = 0;
    while i < 128 {
        let b = i as u8;
        t[i] = if b.is_ascii_alphabetic() {
            LETTER
        } else if b.is_ascii_digit() {
            NUMBER
        } else if matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r') {
            SPACE
        } else {
            OTHER
        };
        i += 1;
    }
    t
};

/// `\p{L}`, `\p{N}` and `\s` of the regex crate, for every char.
struct CharClasses {
    /// Class of each char of the Basic Multilingual Plane.
    bmp: Box<[u8]>,
    /// Ranges above it, with their class (chars in none are `OTHER`), sorted.
    rest: Vec<(u32, u32, u8)>,
}

impl CharClasses {
    fn get() -> Option<&'static CharClasses> {
        static CLASSES: OnceLock<Option<CharClasses>> = OnceLock::new();
        CLASSES.get_or_init(CharClasses::build).as_ref()
    }

    fn ranges(pattern: &str) -> Option<Vec<(u32, u32)>> {
        let hir = regex_syntax::Parser::new().parse(pattern).ok()?;
        match hir.kind() {
            regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(c)) => Some(
                c.ranges()
                    .iter()
                    .map(|r| (u32::from(r.start()), u32::from(r.end())))
                    .collect(),
            ),
            _ => None,
        }
    }

    fn build() -> Option<CharClasses> {
        let mut bmp = vec![OTHER; 0x10000].into_boxed_slice();
        let mut rest = Vec::new();
        for (pattern, class) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\s", SPACE)] {
            for (lo, hi) in CharClasses::ranges(pattern)? {
                for c in lo..=hi.min(0xFFFF) {
                    bmp[c as usize] = class;
                }
                if hi > 0xFFFF {
                    rest.push((lo.max(0x10000), hi, class));
                }
            }
        }
        rest.sort_unstable();
        let classes = CharClasses { bmp, rest };
        // The ASCII table must agree with the regex crate's.
        (0..128u8)
            .all(|b| ASCII_CLASS[b as usize] == classes.of(char::from(b)))
            .then_some(classes)
    }

    #[inline]
    fn of(&self, c: char) -> u8 {
        let c = u32::from(c);
        if c < 0x10000 {
            return self.bmp[c as usize];
        }
        match self.rest.binary_search_by(|&(lo, _, _)| lo.cmp(&c)) {
            Ok(i) => self.rest[i].2,
            Err(0) => OTHER,
            Err(i) => {
                let (_, hi, class) = self.rest[i - 1];
                if c <= hi {
                    class
                } else {
                    OTHER
                }
            }
        }
    }
}

/// One encoder's words, in one thread.
struct WordCache {
    owner: u64,
    words: HashMap<Box<[u8]>, Box<[u32]>, FastHash>,
}

thread_local! {
    static CACHES: RefCell<Vec<WordCache>> = const { RefCell::new(Vec::new()) };
}

fn with_cache<R>(owner: u64, f: impl FnOnce(&mut WordCache) -> R) -> R {
    CACHES.with(|caches| {
        let mut caches = caches.borrow_mut();
        let at = match caches.iter().position(|c| c.owner == owner) {
            Some(i) => i,
            None => {
                if caches.len() >= MAX_CACHES_PER_THREAD {
                    caches.pop();
                }
                caches.insert(
                    0,
                    WordCache {
                        owner,
                        words: HashMap::default(),
                    },
                );
                0
            }
        };
        f(&mut caches[at])
    })
}

/// FxHash (rustc's): quick on short keys; the keys are our own words and token pairs.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

type FastHash = BuildHasherDefault<FxHasher>;

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        }
        let r = chunks.remainder();
        if !r.is_empty() {
            let mut last = [0u8; 8];
            last[..r.len()].copy_from_slice(r);
            self.add(u64::from_le_bytes(last));
        }
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        let m = bytes_to_unicode();
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(m[b'a' as usize], 'a');
        assert_eq!(m[0], 'Ā');
        let mut all: Vec<char> = m.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn classes_come_from_the_regex_tables() {
        let c = CharClasses::get().unwrap();
        assert_eq!(c.of('é'), LETTER);
        assert_eq!(c.of('中'), LETTER);
        assert_eq!(c.of('٣'), NUMBER);
        assert_eq!(c.of('Ⅻ'), NUMBER);
        assert_eq!(c.of('\u{a0}'), SPACE);
        assert_eq!(c.of('\u{3000}'), SPACE);
        assert_eq!(c.of('\u{301}'), OTHER);
        assert_eq!(c.of('😀'), OTHER);
        assert_eq!(c.of('𝐀'), LETTER);
        assert_eq!(c.of('𝟎'), NUMBER);
    }

    /// A toy vocabulary: the 256 byte symbols, then merges "a b", "ab c", "Ġ a".
    fn toy() -> BpeEncoder {
        let chars = bytes_to_unicode();
        let mut vocab = serde_json::Map::new();
        for (i, c) in chars.iter().enumerate() {
            vocab.insert(c.to_string(), serde_json::json!(i + 1));
        }
        for (i, t) in ["ab", "abc", "Ġa"].iter().enumerate() {
            vocab.insert(t.to_string(), serde_json::json!(300 + i));
        }
        vocab.insert("<s>".into(), serde_json::json!(0));
        let json = serde_json::json!({
            "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
            "post_processor": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "vocab": vocab,
                      "merges": ["a b", "ab c", "Ġ a"]},
        });
        BpeEncoder::from_json(&json).unwrap()
    }

    #[test]
    fn toy_vocabulary() {
        let t = toy();
        let byte = |b: u8| b as u32 + 1;
        assert_eq!(t.encode("abc"), vec![301]);
        assert_eq!(t.encode("<s>ab a"), vec![0, 300, 302]);
        assert_eq!(t.encode("a1"), vec![byte(b'a'), byte(b'1')]);
        assert_eq!(t.encode(""), Vec::<u32>::new());
        // Two spaces before a letter: the first alone, the second joins the letter.
        assert_eq!(t.encode("  a"), vec![byte(b' '), 302]);
    }

    #[test]
    fn quoted_special_tokens_are_plain_text() {
        let t = toy();
        let byte = |b: u8| b as u32 + 1;
        let q = '\u{fdd0}';
        let q_ids: Vec<u32> = "\u{fdd0}".bytes().map(byte).collect();
        // Quoted, `<s>` is three chars of text; unquoted, the control token.
        assert_eq!(
            t.encode_quoted("\u{fdd0}<s>ab<s>", q),
            [byte(b'<'), byte(b's'), byte(b'>'), 300, 0]
        );
        assert_eq!(
            t.encode_quoted("a\u{fdd0}<s>bc", q),
            [
                byte(b'a'),
                byte(b'<'),
                byte(b's'),
                byte(b'>'),
                byte(b'b'),
                byte(b'c')
            ]
        );
        // A doubled quote is one quote char of text; a lone one is text too.
        assert_eq!(
            t.encode_quoted("\u{fdd0}\u{fdd0}<s>", q),
            [q_ids.clone(), vec![0]].concat()
        );
        assert_eq!(t.encode_quoted("\u{fdd0}a", q), t.encode("\u{fdd0}a"));
        assert_eq!(t.encode_quoted("a\u{fdd0}", q), t.encode("a\u{fdd0}"));
        // Without a quote char, the quote is an ordinary char.
        assert_eq!(t.encode("\u{fdd0}<s>"), [q_ids, vec![0]].concat());
    }

    #[test]
    fn unsupported_configurations_are_refused() {
        let mut json = serde_json::json!({"normalizer": {"type": "NFC"}});
        assert!(BpeEncoder::from_json(&json).is_none());
        json = serde_json::json!({"normalizer": null, "pre_tokenizer": {"type": "Metaspace"}});
        assert!(BpeEncoder::from_json(&json).is_none());
    }
}
