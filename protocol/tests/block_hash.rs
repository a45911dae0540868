//! The block-hash recipe: published test vectors (also in docs/block-hash.md), an independent
//! re-derivation from the raw bytes, and the properties the recipe promises.

use kvgate_protocol::{BlockHash, BlockHasher, HashParams, KvEvent, KvEventRecord};

fn params() -> HashParams {
    let mut seed = [0u8; 32];
    seed.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    HashParams {
        model_id: "smollm2-135m-instruct".into(),
        weight_version: "b179c952".into(),
        kv_dtype: "f32".into(),
        block_size: 16,
        seed,
    }
}

/// The published vectors: scope "tenant-a", tokens 0..48, three blocks.
const VECTORS: [&str; 3] = [
    "f04f6629273d9055be1553bbda3f810a",
    "607f75848d18099c4d54c7cac6b25008",
    "ed81473f9393c763563a355188fcef62",
];

#[test]
fn published_vectors() {
    let tokens: Vec<u32> = (0..48).collect();
    let hashes = BlockHasher::new(&params()).block_keys("tenant-a", &tokens);
    let got: Vec<String> = hashes.iter().map(|h| h.to_string()).collect();
    assert_eq!(got, VECTORS);
}

fn field(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
    out.push(tag);
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

#[test]
fn recipe_matches_an_independent_derivation() {
    let p = params();
    let mut root_input = Vec::new();
    field(&mut root_input, 1, b"kvgate/kv/v1");
    field(&mut root_input, 1, p.model_id.as_bytes());
    field(&mut root_input, 1, p.weight_version.as_bytes());
    field(&mut root_input, 1, p.kv_dtype.as_bytes());
    field(&mut root_input, 2, &16u32.to_le_bytes());
    field(&mut root_input, 3, &p.seed);
    let root = *blake3::hash(&root_input).as_bytes();
    let mut scope = Vec::new();
    field(&mut scope, 1, b"tenant-a");
    let start = *blake3::keyed_hash(&root, &scope).as_bytes();
    let tokens: Vec<u8> = (0u32..32).flat_map(|t| t.to_le_bytes()).collect();
    let c0 = *blake3::keyed_hash(&start, &tokens[..64]).as_bytes();
    let c1 = *blake3::keyed_hash(&c0, &tokens[64..]).as_bytes();
    let key = |c: [u8; 32]| BlockHash(u128::from_le_bytes(c[..16].try_into().unwrap()));
    let (ours, chain) =
        BlockHasher::new(&p).hash_prefix("tenant-a", &(0..32).collect::<Vec<u32>>());
    assert_eq!(ours, vec![key(c0), key(c1)]);
    assert_eq!(chain.key(), key(c1));
}

#[test]
fn every_input_changes_the_keys() {
    let tokens: Vec<u32> = (0..32).collect();
    let base = BlockHasher::new(&params()).block_keys("tenant-a", &tokens);
    let variants: Vec<HashParams> = vec![
        HashParams {
            model_id: "other".into(),
            ..params()
        },
        HashParams {
            weight_version: "2".into(),
            ..params()
        },
        HashParams {
            kv_dtype: "bf16".into(),
            ..params()
        },
        HashParams {
            seed: [7; 32],
            ..params()
        },
    ];
    for v in variants {
        let h = BlockHasher::new(&v).block_keys("tenant-a", &tokens);
        assert!(h.iter().zip(&base).all(|(a, b)| a != b), "{v:?}");
    }
    let other_scope = BlockHasher::new(&params()).block_keys("tenant-b", &tokens);
    assert!(other_scope.iter().zip(&base).all(|(a, b)| a != b));
    // A change in block 0 changes every later key; a change in block 1 leaves block 0 alone.
    let mut t2 = tokens.clone();
    t2[20] = 999;
    let h2 = BlockHasher::new(&params()).block_keys("tenant-a", &t2);
    assert_eq!(h2[0], base[0]);
    assert_ne!(h2[1], base[1]);
}

#[test]
fn fields_are_length_prefixed() {
    // "ab" + "c" and "a" + "bc" would collide if fields were simply concatenated.
    let a = HashParams {
        model_id: "ab".into(),
        weight_version: "c".into(),
        ..params()
    };
    let b = HashParams {
        model_id: "a".into(),
        weight_version: "bc".into(),
        ..params()
    };
    let t: Vec<u32> = (0..16).collect();
    assert_ne!(
        BlockHasher::new(&a).block_keys("s", &t),
        BlockHasher::new(&b).block_keys("s", &t)
    );
}

#[test]
fn partial_blocks_have_no_key_and_block_size_binds() {
    let h = BlockHasher::new(&params());
    assert_eq!(h.block_keys("s", &(0..47).collect::<Vec<u32>>()).len(), 2);
    let (keys, chain) = h.hash_prefix("s", &[1, 2, 3]);
    assert!(keys.is_empty());
    assert_eq!(
        chain,
        h.start("s"),
        "no full block: the chain is the scope's start"
    );
    // Extending from a chain equals hashing the whole prefix.
    let t: Vec<u32> = (0..64).collect();
    let (head, mid) = h.hash_prefix("s", &t[..32]);
    let (tail, end) = h.extend(mid, &t[32..]);
    let (all, end2) = h.hash_prefix("s", &t);
    assert_eq!([head, tail].concat(), all);
    assert_eq!(end, end2);
    let h8 = BlockHasher::new(&HashParams {
        block_size: 8,
        ..params()
    });
    let t: Vec<u32> = (0..16).collect();
    assert_ne!(h8.block_keys("s", &t)[1], h.block_keys("s", &t)[0]);
}

#[test]
fn hashes_and_events_round_trip_through_json() {
    let h = BlockHash(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
    let json = serde_json::to_string(&h).unwrap();
    assert_eq!(json, "\"0123456789abcdef0011223344556677\"");
    assert_eq!(serde_json::from_str::<BlockHash>(&json).unwrap(), h);
    assert!(serde_json::from_str::<BlockHash>("\"xyz\"").is_err());
    assert!("0123".parse::<BlockHash>().is_err());
    let rec = KvEventRecord {
        seq: 7,
        event: KvEvent::BlockStored {
            hashes: vec![h],
            parent: None,
            scope: "t".into(),
        },
    };
    let json = serde_json::to_value(&rec).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"seq": 7, "type": "BlockStored", "hashes": [h.to_string()], "parent": null, "scope": "t"})
    );
    assert_eq!(serde_json::from_value::<KvEventRecord>(json).unwrap(), rec);
}
