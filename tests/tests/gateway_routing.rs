//! Prefix-aware routing across three real SmolLM2 engines: six tenants with distinct ~300-token
//! system prompts each stay on the engine holding their prefix, load stays balanced, scopes
//! isolate, and draining an engine mid-run loses nothing.

use kvgate_tests::gateway::{chat_body, config, gated_engine, StoreKind, TestGateway};
use kvgate_tests::Response;
use serde_json::json;
use std::collections::HashMap;

const WORDS: &[&str] = &[
    "account",
    "billing",
    "customer",
    "delivery",
    "engine",
    "factory",
    "garden",
    "harbor",
    "invoice",
    "journey",
    "kitchen",
    "ledger",
    "market",
    "network",
    "office",
    "payment",
    "quarter",
    "refund",
    "service",
    "ticket",
    "update",
    "vendor",
    "warranty",
    "yield",
    "always",
    "never",
    "politely",
    "briefly",
    "carefully",
    "clearly",
    "quickly",
    "kindly",
];

/// A distinct system prompt of about 300 tokens for tenant `i`.
fn system_prompt(i: u64) -> String {
    let mut x = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1);
    let mut s = format!("You are the support assistant of company number {i}. ");
    for n in 0..240 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        s.push(if n % 12 == 11 { '.' } else { ' ' });
    }
    s
}

fn cached(r: &Response) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage: {}", r.body))
}

fn engine_of(r: &Response) -> String {
    assert_eq!(r.status, 200, "{}", r.body);
    r.header("x-kvgate-engine")
        .expect("engine header")
        .to_owned()
}

#[test]
fn tenants_stay_on_their_prefix_balanced_and_isolated() {
    let engines: Vec<_> = (0..3).map(|_| gated_engine("blocks = 2048")).collect();
    let names = ["e0", "e1", "e2"];
    let cfg = config(
        &names
            .iter()
            .zip(&engines)
            .map(|(n, e)| (*n, e.addr))
            .collect::<Vec<_>>(),
    );
    let gw = TestGateway::start(cfg, StoreKind::Memory);
    gw.wait_ready(3);
    let tenants: Vec<(String, String, String)> = (0..6)
        .map(|i| {
            let id = format!("t{i}");
            let key = gw.tenant(&id, json!({}));
            (id, key, system_prompt(i))
        })
        .collect();

    // Warm-up: one request each; the engine that answers holds the tenant's prefix.
    let mut home = HashMap::new();
    let mut prompts = Vec::new();
    for (id, key, system) in &tenants {
        let r = gw.chat(
            key,
            Some(system),
            "Hello, who are you?",
            r#","max_tokens":1"#,
        );
        let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            (280..400).contains(&prompt),
            "system prompt tokens: {prompt}"
        );
        prompts.push(prompt);
        home.insert(id.clone(), engine_of(&r));
    }

    // The rounds start once the gateway knows every full block of the warm-up prompts.
    let block = gw.gw.router.config().block_size as u64;
    gw.wait_indexed(prompts.iter().map(|p| p / block).sum());

    // Five rounds, each tenant's requests sent concurrently.
    let mut per_engine: HashMap<String, usize> = HashMap::new();
    let mut on_home = HashMap::<String, (usize, usize)>::new();
    for round in 0..5 {
        let results: Vec<(String, Response)> = std::thread::scope(|s| {
            let handles: Vec<_> = tenants
                .iter()
                .map(|(id, key, system)| {
                    let gw = &gw;
                    s.spawn(move || {
                        let q = format!("Question {round}: where is my order number {round}{id}?");
                        (
                            id.clone(),
                            gw.chat(key, Some(system), &q, r#","max_tokens":1"#),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (id, r) in results {
            let e = engine_of(&r);
            *per_engine.entry(e.clone()).or_default() += 1;
            let entry = on_home.entry(id.clone()).or_default();
            entry.1 += 1;
            if e == home[&id] {
                entry.0 += 1;
                assert!(
                    cached(&r) >= 272,
                    "{id} on its home reuses the prefix: {}",
                    r.body
                );
            }
        }
    }
    let decisions = || {
        gw.metrics()
            .lines()
            .filter(|l| l.starts_with("kvgate_gateway_route_decisions_total"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    for (id, (hits, total)) in &on_home {
        assert!(
            *hits as f64 >= 0.95 * *total as f64,
            "{id}: {hits}/{total} on its prefix engine (homes {home:?}; {})",
            decisions()
        );
    }
    let mean = 30.0 / 3.0;
    for (e, n) in &per_engine {
        assert!(
            *n as f64 <= 1.5 * mean,
            "{e} took {n} of 30 ({per_engine:?})"
        );
    }
    let m = gw.metrics();
    assert!(
        m.contains("kvgate_gateway_route_decisions_total{reason=\"prefix\"} 30"),
        "{m}"
    );

    // Scopes: the same system prompt in another tenant's own scope is never a hit; in a
    // shared scope it is.
    let shared_prompt = system_prompt(100);
    let x1 = gw.tenant("x1", json!({}));
    let x2 = gw.tenant("x2", json!({}));
    let s1 = gw.tenant("s1", json!({"cache_scope": "team"}));
    let s2 = gw.tenant("s2", json!({"cache_scope": "team"}));
    let r = gw.chat(&x1, Some(&shared_prompt), "Hi", r#","max_tokens":1"#);
    assert_eq!(cached(&r), 0);
    let r = gw.chat(&x2, Some(&shared_prompt), "Hi", r#","max_tokens":1"#);
    assert_eq!(cached(&r), 0, "x2 must not hit x1's blocks");
    let r = gw.chat(&s1, Some(&shared_prompt), "Hi", r#","max_tokens":1"#);
    assert_eq!(cached(&r), 0, "the team scope starts empty");
    let r = gw.chat(&s2, Some(&shared_prompt), "Hi", r#","max_tokens":1"#);
    assert!(cached(&r) >= 272, "s2 shares s1's scope: {}", r.body);

    // Drain the busiest tenant's engine mid-run: its streams finish, nothing new reaches it.
    let (victim_id, victim_key, victim_sys) = &tenants[0];
    let drained = home[victim_id].clone();
    let streams: Vec<Response> = std::thread::scope(|s| {
        let handles: Vec<_> = tenants
            .iter()
            .map(|(_, key, system)| {
                let gw = &gw;
                s.spawn(move || {
                    gw.post(
                        key,
                        "/v1/chat/completions",
                        &chat_body(
                            Some(system),
                            "Tell me a long story.",
                            r#","max_tokens":48,"ignore_eos":true,"stream":true"#,
                        ),
                    )
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let r = gw.admin("POST", &format!("/admin/engines/{drained}/drain"), "");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["draining"], true);
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &streams {
        assert_eq!(r.status, 200, "{}", r.body);
        let data = r.sse_data();
        assert_eq!(
            data.last().map(String::as_str),
            Some("[DONE]"),
            "{}",
            r.body
        );
        assert!(!r.body.contains("\"error\""), "{}", r.body);
    }
    for (id, key, system) in &tenants {
        let r = gw.chat(key, Some(system), "After the drain?", r#","max_tokens":1"#);
        assert_ne!(engine_of(&r), drained, "a drained engine got a new request");
        // The drained engine's tenants are sent elsewhere with a hint, and their prefix is
        // fetched from it rather than computed.
        if home[id] == drained {
            assert!(
                cached(&r) >= 272,
                "{id}'s prefix was computed again: {}",
                r.body
            );
        }
    }
    let r = gw.chat(
        victim_key,
        Some(victim_sys),
        "Still served?",
        r#","max_tokens":1"#,
    );
    assert_eq!(r.status, 200);
    let r = gw.admin(
        "POST",
        &format!("/admin/engines/{drained}/drain?wait=30"),
        "",
    );
    assert_eq!(r.json()["drained"], true, "{}", r.body);
    let r = gw.admin("POST", &format!("/admin/engines/{drained}/undrain"), "");
    assert_eq!(r.json()["draining"], false, "{}", r.body);

    // A gain of a block or two is fetched too. A question of the victim's, asked twice while
    // its home drained, is answered elsewhere: the first ask finds the system prompt there
    // (fetched after the drain), the second the question's own blocks as well.
    let drain = |name: &str, on: bool| {
        let verb = if on { "drain?wait=30" } else { "undrain" };
        let r = gw.admin("POST", &format!("/admin/engines/{name}/{verb}"), "");
        assert_eq!(r.status, 200, "{}", r.body);
    };
    drain(&drained, true);
    let question = "Where is parcel number 7? It left your warehouse last Monday morning, and \
                    since then its tracking page has shown no update at all. Could you look?";
    let first = gw.chat(victim_key, Some(victim_sys), question, r#","max_tokens":1"#);
    let taker = engine_of(&first);
    let whole = gw.chat(victim_key, Some(victim_sys), question, r#","max_tokens":1"#);
    assert_eq!(engine_of(&whole), taker, "{}", decisions());
    let gain = cached(&whole) - cached(&first);
    assert!(
        (1..4).contains(&(gain / block)) && cached(&first) >= 272,
        "the question's own blocks: {} then {} tokens cached",
        cached(&first),
        cached(&whole)
    );
    // Back from its drain, the home holds the system prompt and not the question. With the
    // other two draining, the question goes home, which fetches the question's blocks from
    // the engine that computed them.
    drain(&drained, false);
    let third = names
        .iter()
        .find(|n| **n != drained && **n != taker)
        .unwrap();
    drain(&taker, true);
    drain(third, true);
    let r = gw.chat(victim_key, Some(victim_sys), question, r#","max_tokens":1"#);
    assert_eq!(engine_of(&r), drained);
    assert_eq!(cached(&r), cached(&whole), "{}", r.body);
    drain(&taker, false);
    drain(third, false);
}
