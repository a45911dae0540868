//! The engine that sends a request's prefix to the one it is routed to ([`peer_for`]): one that
//! holds it ([`best_peer`]), or one still computing it for a request routed there
//! ([`computing_peer`]), and how many blocks to ask of it ([`fetch_run`]), judged by when it
//! will have them. The gateway and the routing simulator both name peers through [`peer_for`].

use super::{Candidate, Engine, Registry};
use crate::routing::index::{PrefixIndex, MAX_ENGINES};
use hyper::header::{HeaderName, HeaderValue};
use std::sync::Arc;

pub use crate::routing::PEER_MIN_GAIN_BLOCKS;

/// Of the engines in `peers` (a slot mask of those that may send a prefix), other than `chosen`
/// and those in `exclude`, the one whose device pool or host tier holds the longest leading run
/// of `hashes`, with that run's length (none when no one holds any); of equal runs, the higher
/// slot's.
pub fn best_peer(
    index: &PrefixIndex,
    hashes: &[kvgate_protocol::BlockHash],
    peers: u64,
    chosen: usize,
    exclude: u64,
) -> Option<(usize, u32)> {
    let mask = peers & !exclude & !(1u64 << chosen);
    if mask == 0 {
        return None;
    }
    let matched = index.longest_tier_matches(hashes, mask);
    (0..MAX_ENGINES)
        .filter(|s| mask & (1 << s) != 0 && matched[*s].fast > 0)
        .map(|s| (s, matched[s].fast))
        .max_by_key(|&(s, n)| (n, s))
}

/// Among `candidates` other than `chosen` (the engine a request is routed to, before that request
/// counts as routed there), the one that is computing the longest leading run of `hashes` for
/// requests routed to it ([`PrefixIndex::route`]: its KV events have not confirmed those blocks
/// yet, or it has not reached them), with that run's length. Only when:
/// - the run is at least [`PEER_MIN_GAIN_BLOCKS`] longer than what `chosen` caches or is
///   computing itself;
/// - the time before it will have computed them is within the time `chosen` waits for a fetch
///   ([`kvgate_protocol::load::peer_fetch_limit_secs`]), as [`within_limit`] judges it: the
///   run named is the longest that is.
///
/// `chosen` then asks that engine for the blocks, and its answer waits for the step that
/// computes them. The request waits for them rather than have `chosen` compute the prompt a
/// second time, even where that recompute would end sooner: the wait delays this request
/// alone, within the limit, while a recompute takes `chosen`'s compute from every request in
/// flight there and keeps a second copy of the prefix in the fleet's caches.
pub fn computing_peer(
    index: &PrefixIndex,
    hashes: &[kvgate_protocol::BlockHash],
    candidates: &[Candidate],
    chosen: &Candidate,
    now_ms: u64,
) -> Option<(usize, u32)> {
    let all = candidates.iter().fold(0u64, |m, c| m | (1 << c.slot));
    if all == 1 << chosen.slot {
        return None;
    }
    let runs = index.longest_routed(hashes, all);
    let own = chosen.matched_blocks.max(runs[chosen.slot]);
    let floor = own + PEER_MIN_GAIN_BLOCKS - 1;
    // Longest runs first: one that cannot beat the best found is not looked into.
    let mut order: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.slot != chosen.slot && runs[c.slot] > floor)
        .collect();
    order.sort_by(|a, b| runs[b.slot].cmp(&runs[a.slot]));
    let mut best: Option<(usize, u32, f64)> = None;
    for c in order {
        if best.is_some_and(|(_, n, _)| runs[c.slot] < n) {
            break;
        }
        let Some((n, wait)) = within_limit(
            index,
            hashes,
            (c.slot, c.wait_secs),
            (floor, runs[c.slot]),
            own,
            now_ms,
        ) else {
            continue;
        };
        // The longer run; on a tie, the shorter wait.
        if best.is_none_or(|(_, bn, bw)| n > bn || (n == bn && wait < bw)) {
            best = Some((c.slot, n, wait));
        }
    }
    best.map(|(slot, n, _)| (slot, n))
}

/// Of the leading blocks of `hashes` that engine `slot` holds or is computing (`run`, at least
/// `floor` of them), the longest run that it will have within the time a fetch of the blocks
/// past `own` may take ([`kvgate_protocol::load::peer_fetch_limit_secs`]), and how long before
/// it has them. `None` when no run past `floor` is within the limit.
///
/// A block the engine holds in its device pool or host tier is there now. One it is computing
/// is due when the earliest request in flight there with it was expected to have computed it,
/// and no later than `wait` (its wait for a new request; infinite for an engine that takes
/// none, a draining one). Once that time has passed the block is taken as about to come (the
/// request is still in flight), until it is overdue by twice the limit: then the estimate was
/// wrong (the request was pushed back, or the engine is slower than it said), and `wait` is
/// all there is. Where no request said when, `wait`.
///
/// Under a burst an engine's wait for a new request says little of a request already in its
/// batch: a tenant's first request, routed with 0.75 s of wait, had the next one, 0.44 s later,
/// see 1.88 s of wait there and compute the prompt a second time elsewhere. And a request
/// routed later with more of the prompt (the same question) must not make the rest wait for it.
///
/// A block's due time never comes before its predecessor's (whatever computes it computes
/// those first), so the longest run is found by bisection: a few probes of the index, whatever
/// the prompt's length.
fn within_limit(
    index: &PrefixIndex,
    hashes: &[kvgate_protocol::BlockHash],
    (slot, wait): (usize, f64),
    (floor, run): (u32, u32),
    own: u32,
    now_ms: u64,
) -> Option<(u32, f64)> {
    let due = |n: u32| -> Option<f64> {
        let limit = kvgate_protocol::load::peer_fetch_limit_secs(n.saturating_sub(own) as usize);
        let hash = *hashes.get((n as usize).checked_sub(1)?)?;
        let secs = match index.ready_ms(slot, hash) {
            Some(ready) => {
                let left = (ready as f64 - now_ms as f64) / 1e3;
                if left < -2.0 * limit {
                    wait
                } else {
                    wait.min(left.max(0.0))
                }
            }
            None => wait,
        };
        (secs <= limit).then_some(secs)
    };
    let run = run.min(hashes.len() as u32);
    if run <= floor {
        return None;
    }
    if let Some(secs) = due(run) {
        return Some((run, secs));
    }
    // The longest run in (floor, run) that is due in time: `lo` is, or is `floor`; `hi` is not.
    let (mut lo, mut hi) = (floor, run);
    let mut best = None;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match due(mid) {
            Some(secs) => {
                lo = mid;
                best = Some((mid, secs));
            }
            None => hi = mid,
        }
    }
    best
}

/// How many leading blocks of `hashes` an engine should fetch from `peer`, which holds `held` of
/// them in its device pool or host tier and may be computing more, when it holds `own` itself:
/// the held ones, and those past them that `peer` will have within the fetch's time limit
/// ([`within_limit`]; a peer not among `candidates`, a draining one, by its requests' due times
/// alone).
pub fn fetch_run(
    index: &PrefixIndex,
    hashes: &[kvgate_protocol::BlockHash],
    candidates: &[Candidate],
    peer: usize,
    (held, own): (u32, u32),
    now_ms: u64,
) -> u32 {
    if peer >= MAX_ENGINES {
        return held;
    }
    let wait = candidates
        .iter()
        .find(|c| c.slot == peer)
        .map_or(f64::INFINITY, |c| c.wait_secs);
    let run = index.longest_routed(hashes, 1 << peer)[peer];
    within_limit(index, hashes, (peer, wait), (held, run), own, now_ms).map_or(held, |(n, _)| n)
}

/// The engine that `chosen` (among `candidates`) should fetch the prompt's prefix from, as the
/// gateway names it: the one holding the longest run of `hashes` ([`best_peer`], of those in
/// `peers` and not in `exclude`) where fetching its blocks past `chosen`'s own costs less than
/// computing them ([`Candidate::fetch_pays`]), asked for as far as it will have them in time
/// ([`fetch_run`]); else one still computing them ([`computing_peer`]).
pub fn peer_for(
    index: &PrefixIndex,
    hashes: &[kvgate_protocol::BlockHash],
    candidates: &[Candidate],
    chosen: &Candidate,
    (peers, exclude): (u64, u64),
    block_size: u32,
    now_ms: u64,
) -> Option<Peer> {
    let own = chosen.matched_blocks;
    best_peer(index, hashes, peers, chosen.slot, exclude)
        .filter(|&(_, held)| chosen.fetch_pays(held.saturating_sub(own), block_size))
        .map(|(slot, held)| {
            let blocks = fetch_run(index, hashes, candidates, slot, (held, own), now_ms);
            Peer {
                slot,
                blocks,
                computing: blocks > held,
            }
        })
        .or_else(|| {
            computing_peer(index, hashes, candidates, chosen, now_ms).map(|(slot, blocks)| Peer {
                slot,
                blocks,
                computing: true,
            })
        })
}

/// A peer named for a request: its slot, how many of the prompt's leading blocks to fetch from
/// it, and whether it is still computing some of those (for a request routed there): then the
/// fetch waits for its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub slot: usize,
    pub blocks: u32,
    pub computing: bool,
}

impl Peer {
    /// The hint the request carries to its engine: the peer's base URL, how many of the
    /// prompt's leading blocks to fetch (those the peer holds, and those it will have computed
    /// within the fetch's time limit), and, for a peer still computing some of them, `1` in
    /// `x-kvgate-prefix-peer-computing`: the fetch waits for the peer's steps, which says
    /// nothing of how long a transfer takes, so the engine leaves it out of its measured rate.
    /// (An iterator, not a list: the proxy adds them to its own.)
    pub fn headers(&self, url: HeaderValue) -> impl Iterator<Item = (HeaderName, HeaderValue)> {
        let computing = self.computing.then(|| {
            (
                HeaderName::from_static("x-kvgate-prefix-peer-computing"),
                HeaderValue::from_static("1"),
            )
        });
        [
            Some((HeaderName::from_static("x-kvgate-prefix-peer"), url)),
            Some((
                HeaderName::from_static("x-kvgate-prefix-peer-blocks"),
                HeaderValue::from(self.blocks),
            )),
            computing,
        ]
        .into_iter()
        .flatten()
    }
}

impl Registry {
    /// [`peer_for`] on this gateway's index, of the engines that can send a prefix now (up,
    /// circuit closed; a draining one counts, its cache is still good): the engine, and what
    /// to fetch from it.
    pub fn peer_for(
        &self,
        hashes: &[kvgate_protocol::BlockHash],
        candidates: &[Candidate],
        chosen: &Candidate,
        exclude: u64,
        block_size: u32,
        now_ms: u64,
    ) -> Option<(Arc<Engine>, Peer)> {
        let all = self.all();
        let peers = all
            .iter()
            .filter(|e| e.can_be_peer(now_ms))
            .fold(0u64, |m, e| m | (1 << e.slot));
        let index = self.index.read().unwrap_or_else(|p| p.into_inner());
        let to = (peers, exclude);
        let peer = peer_for(&index, hashes, candidates, chosen, to, block_size, now_ms)?;
        drop(index);
        all.into_iter()
            .find(|e| e.slot == peer.slot)
            .map(|e| (e, peer))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{candidates, config, fleet};
    use super::super::{now_ms, RouteRequest};
    use super::*;
    use kvgate_protocol::BlockHash;

    /// The peer `registry` names, and the blocks to fetch from it, for a request of `hashes`
    /// routed to engine `chosen` among `c`.
    fn named(
        registry: &Registry,
        hashes: &[BlockHash],
        c: &[Candidate],
        chosen: usize,
        now: u64,
    ) -> Option<(String, u32)> {
        let chosen = c.iter().find(|x| x.slot == chosen)?;
        let block = config().block_size;
        (registry.peer_for(hashes, c, chosen, 0, block, now))
            .map(|(e, p)| (e.name.clone(), p.blocks))
    }

    #[test]
    fn the_hint_says_computing_only_for_a_peer_still_computing() {
        let url = HeaderValue::from_static("http://10.0.0.7:8001");
        let sent = |p: Peer| -> Vec<(String, String)> {
            (p.headers(url.clone()))
                .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                .collect()
        };
        let pair = |n: &str, v: &str| (n.to_owned(), v.to_owned());
        let holder = Peer {
            slot: 1,
            blocks: 11,
            computing: false,
        };
        let hint = vec![
            pair("x-kvgate-prefix-peer", "http://10.0.0.7:8001"),
            pair("x-kvgate-prefix-peer-blocks", "11"),
        ];
        assert_eq!(sent(holder), hint);
        let computing = Peer {
            computing: true,
            ..holder
        };
        let mut with = hint.clone();
        with.push(pair("x-kvgate-prefix-peer-computing", "1"));
        assert_eq!(sent(computing), with);
    }

    #[test]
    fn an_engine_computing_the_prefix_is_judged_by_when_its_request_will_have_computed_it() {
        let (registry, engines, hashes) = fleet(2, &[]);
        let req = RouteRequest::new(&hashes, 270, "t", &config());
        let mut c = registry.candidates(&req, 0, now_ms()).0;
        // Engine 1 has 3 s of wait for a new request, far past the 1.4 s engine 0 waits for a
        // fetch of 16 blocks.
        c[1].wait_secs = 3.0;
        // One clock for the whole test: the routes' times are relative to it.
        let now = now_ms();
        let named = |c: &[Candidate]| named(&registry, &hashes, c, engines[0].slot, now);
        let e1 = |n: u32| Some(("e1".to_owned(), n));
        // A request computing the prompt there, routed with no more than 0.2 s ahead of it:
        // the prompt is that far away, whatever a new request would wait.
        let soon = registry.route(engines[1].slot, &hashes, now + 200);
        assert_eq!(named(&c), e1(16));
        // A later one changes nothing: the earliest counts while it is in flight.
        let later = registry.route(engines[1].slot, &hashes, now + 5_000);
        assert_eq!(named(&c), e1(16));
        // Once it ends, when the others expect to have computed it is not known (the earliest
        // is not kept per request): a new request's wait is all there is.
        drop(soon);
        assert_eq!(named(&c), None);
        drop(later);
        // Due in 2 s: past the limit.
        let far = registry.route(engines[1].slot, &hashes, now + 2_000);
        assert_eq!(named(&c), None);
        // But no later than a new request's wait there.
        c[1].wait_secs = 1.0;
        assert_eq!(named(&c), e1(16));
        c[1].wait_secs = 3.0;
        // A request with the first 11 blocks, due sooner: those 11 are named, not the 16 that
        // the later one will have.
        let part = registry.route(engines[1].slot, &hashes[..11], now + 300);
        assert_eq!(named(&c), e1(11));
        drop((far, part));
        // Overdue: the engine is about to hold it, and the fetch waits (within its limit) for
        // the step that does.
        let overdue = registry.route(engines[1].slot, &hashes, now - 2_000);
        assert_eq!(named(&c), e1(16));
        drop(overdue);
        // Overdue by more than twice the limit: the estimate was wrong.
        let stale = registry.route(engines[1].slot, &hashes, now - 3_000);
        assert_eq!(named(&c), None);
        drop(stale);
        // Not said: the wait for a new request is all there is to go on.
        let unknown = registry.route(engines[1].slot, &hashes, u64::MAX);
        assert_eq!(named(&c), None);
        drop(unknown);
        assert_eq!(registry.index.read().unwrap().routed_len(), 0);
    }

    #[test]
    fn a_holder_still_computing_more_of_the_prompt_is_fetched_from_as_far_as_it_will_have_it() {
        let (registry, engines, hashes) = fleet(2, &[]);
        {
            // Engine 1 holds the first 8 blocks.
            let mut index = registry.index.write().unwrap();
            for h in &hashes[..8] {
                index.insert(engines[1].slot, *h);
            }
        }
        let mut c = candidates(&registry, &hashes, "t");
        c[1].wait_secs = 3.0;
        let now = now_ms();
        // Engine 0 is chosen; engine 1 is named, holding 8 blocks and maybe computing more.
        let run = |c: &[Candidate]| named(&registry, &hashes, c, engines[0].slot, now);
        let e1 = |n: u32| Some(("e1".to_owned(), n));
        // Whether the engine is told that the peer is still computing some of what it fetches
        // (that fetch's time says nothing of a transfer's).
        let computing = |c: &[Candidate]| {
            let chosen = c.iter().find(|x| x.slot == engines[0].slot)?;
            let block = config().block_size;
            (registry.peer_for(&hashes, c, chosen, 0, block, now)).map(|(_, p)| p.computing)
        };
        assert_eq!(run(&c), e1(8));
        assert_eq!(computing(&c), Some(false));
        // A request there computes all 16, due in 0.3 s: the fetch takes them all.
        let soon = registry.route(engines[1].slot, &hashes, now + 300);
        assert_eq!(run(&c), e1(16));
        assert_eq!(computing(&c), Some(true));
        drop(soon);
        // Due in 3 s: the held 8 alone (the fetch would wait out its limit for the rest).
        let late = registry.route(engines[1].slot, &hashes, now + 3_000);
        assert_eq!(run(&c), e1(8));
        // Not a candidate (draining, say): judged by its requests' due times alone.
        let not_candidate = |c: &[Candidate]| run(&c[..1]);
        assert_eq!(not_candidate(&c), e1(8));
        drop(late);
        let soon = registry.route(engines[1].slot, &hashes, now + 300);
        assert_eq!(not_candidate(&c), e1(16));
        drop(soon);
        // Of a run partly due in time, the part that is.
        let part = registry.route(engines[1].slot, &hashes[..12], now + 100);
        let rest = registry.route(engines[1].slot, &hashes, now + 3_000);
        assert_eq!(run(&c), e1(12));
        drop((part, rest));
    }

    #[test]
    fn an_engine_computing_the_prefix_is_named_while_its_wait_is_within_the_fetch_limit() {
        let (registry, engines, hashes) = fleet(3, &[]);
        let req = RouteRequest::new(&hashes, 270, "t", &config());
        let mut c = registry.candidates(&req, 0, now_ms()).0;
        let name = |c: &[Candidate], chosen: usize| {
            named(&registry, &hashes, c, engines[chosen].slot, now_ms()).map(|(e, _)| e)
        };
        // Nothing routed anywhere: no one to ask.
        assert_eq!(name(&c, 0), None);
        // A request with the whole prompt is in flight on engine 1, which has 0.1 s of queue.
        let routed = registry.route(engines[1].slot, &hashes, u64::MAX);
        c[1].wait_secs = 0.1;
        assert_eq!(name(&c, 0).as_deref(), Some("e1"));
        // Its events confirmed nothing yet: the held index knows nothing of it.
        let index = registry.index.read().unwrap();
        assert!(best_peer(&index, &hashes, u64::MAX, engines[0].slot, 0).is_none());
        drop(index);
        // Behind 1.2 s of queue, far more than computing the 16 blocks at an idle engine 0 with
        // free blocks (0.256 s), it is still waited for: within the 1.4 s engine 0 waits for a
        // fetch of 16 blocks.
        c[1].wait_secs = 1.2;
        c[0].free_blocks = 16;
        assert_eq!(name(&c, 0).as_deref(), Some("e1"));
        // Of two engines computing it, the one with the longer run; on a tie, the shorter wait.
        let part = registry.route(engines[2].slot, &hashes[..8], u64::MAX);
        c[2].wait_secs = 0.0;
        assert_eq!(name(&c, 0).as_deref(), Some("e1"));
        let whole = registry.route(engines[2].slot, &hashes, u64::MAX);
        assert_eq!(name(&c, 0).as_deref(), Some("e2"));
        // A gain under PEER_MIN_GAIN_BLOCKS over what the chosen engine caches, or is computing
        // itself for another request, names no one.
        c[0].matched_blocks = 13;
        assert_eq!(name(&c, 0), None);
        c[0].matched_blocks = 0;
        let own = registry.route(engines[0].slot, &hashes[..13], u64::MAX);
        assert_eq!(name(&c, 0), None);
        drop(own);
        assert_eq!(name(&c, 0).as_deref(), Some("e2"));
        // Nor a wait past what the chosen engine waits for a fetch (1.4 s for 16 blocks), however
        // dear the recompute.
        c[0].inflight = 8;
        c[0].free_blocks = 0;
        c[2].wait_secs = 1.5;
        c[1].wait_secs = 1.5;
        assert_eq!(name(&c, 0), None);
        c[1].wait_secs = 1.35;
        assert_eq!(name(&c, 0).as_deref(), Some("e1"));
        c[2].wait_secs = 0.0;
        // Once its requests end, an engine is computing nothing.
        drop((routed, part, whole));
        assert_eq!(name(&c, 0), None);
        assert_eq!(registry.index.read().unwrap().routed_len(), 0);
    }
}
