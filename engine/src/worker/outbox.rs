//! A request's output channel as the engine thread sees it: bounded (the HTTP side sizes it) and
//! never waited on, so one client that stops reading can neither block the engine nor make it
//! buffer without end.
//!
//! A piece that finds the channel full is not sent: its sample keeps the text (it has it anyway)
//! and sends it with the next piece, so a slow reader gets fewer, larger pieces and nothing is
//! lost. Each sample's last piece and the request's end have slots reserved when the request
//! arrives, so they always go out. The first refused piece starts a stall clock; the next piece
//! that goes through stops it. The engine cancels a request whose clock passed the stall timeout
//! while the channel is still full ([`Outbox::is_stalled`]).

use super::Event;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::{OwnedPermit, Sender};
use tokio::sync::oneshot;

/// Why a piece was not sent.
#[derive(Debug)]
pub enum Refused {
    /// The buffer is full; the event comes back so its content can be kept.
    Full(Event),
    /// The receiver is gone (the client left).
    Closed,
}

/// The engine thread's end of one request's output.
#[derive(Debug)]
pub struct Outbox {
    tx: Sender<Event>,
    /// Per sample: the slot reserved for its last piece.
    last: Vec<Option<OwnedPermit<Event>>>,
    /// The slot reserved for `Done` or `Failed`.
    end: Option<OwnedPermit<Event>>,
    stalled_since: Option<Instant>,
    /// Told when the request is cancelled as stalled, so the HTTP side stops waiting on the
    /// client too.
    on_stall: Option<oneshot::Sender<()>>,
}

impl Outbox {
    /// Reserves the last-piece slots of `samples` samples and the end slot; `None` when the
    /// receiver is already gone or the channel is too small to reserve them.
    pub fn new(tx: Sender<Event>, samples: usize, on_stall: oneshot::Sender<()>) -> Option<Self> {
        let reserve = || tx.clone().try_reserve_owned().ok();
        let last = (0..samples)
            .map(|_| reserve().map(Some))
            .collect::<Option<Vec<_>>>()?;
        let end = Some(reserve()?);
        Some(Outbox {
            tx,
            last,
            end,
            stalled_since: None,
            on_stall: Some(on_stall),
        })
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Whether a piece would be taken now.
    pub fn has_room(&self) -> bool {
        self.tx.capacity() > 0
    }

    /// Sends a piece that is not its sample's last. A refused piece starts the stall clock (it
    /// keeps running from the first); a sent one stops it.
    pub fn piece(&mut self, event: Event, now: Instant) -> Result<(), Refused> {
        match self.tx.try_send(event) {
            Ok(()) => {
                self.stalled_since = None;
                Ok(())
            }
            Err(TrySendError::Full(event)) => {
                self.full(now);
                Err(Refused::Full(event))
            }
            Err(TrySendError::Closed(_)) => Err(Refused::Closed),
        }
    }

    /// Notes that a piece was held back for want of room.
    pub fn full(&mut self, now: Instant) {
        self.stalled_since.get_or_insert(now);
    }

    /// Sends sample `index`'s last piece in its reserved slot. False when the client is gone.
    pub fn last_piece(&mut self, index: usize, event: Event) -> bool {
        match self.last.get_mut(index).and_then(Option::take) {
            Some(permit) => {
                permit.send(event);
                !self.tx.is_closed()
            }
            // Each sample ends once; should one end twice, its piece still must not block.
            None => !matches!(self.tx.try_send(event), Err(TrySendError::Closed(_))),
        }
    }

    /// Sends the request's end (`Done` or `Failed`) in its reserved slot.
    pub fn end(mut self, event: Event) {
        match self.end.take() {
            Some(permit) => {
                permit.send(event);
            }
            None => {
                let _ = self.tx.try_send(event);
            }
        }
    }

    /// Whether the client has let the buffer stay full for `timeout`. A buffer with room again
    /// (the client read, and no piece was offered since) stops the clock.
    pub fn is_stalled(&mut self, now: Instant, timeout: Duration) -> bool {
        let Some(since) = self.stalled_since else {
            return false;
        };
        if self.has_room() {
            self.stalled_since = None;
            return false;
        }
        now.duration_since(since) >= timeout
    }

    /// Cancels the request as stalled: the HTTP side is told, and every reserved slot goes.
    pub fn stall(mut self) {
        if let Some(tx) = self.on_stall.take() {
            let _ = tx.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    fn piece(text: &str) -> Event {
        Event::Piece {
            index: 0,
            text: text.into(),
            logprobs: Vec::new(),
            finish: None,
        }
    }

    #[test]
    fn full_buffer_refuses_pieces_but_never_the_ends() {
        // Room for one piece plus the reserved last piece and end.
        let (tx, mut rx) = mpsc::channel(3);
        let (stall_tx, _stall_rx) = oneshot::channel();
        let mut out = Outbox::new(tx, 1, stall_tx).unwrap();
        let t0 = Instant::now();
        let timeout = Duration::from_secs(30);
        assert!(out.piece(piece("a"), t0).is_ok());
        assert!(!out.has_room());
        assert!(matches!(out.piece(piece("b"), t0), Err(Refused::Full(_))));
        assert!(!out.is_stalled(t0, timeout));
        assert!(out.is_stalled(t0 + timeout, timeout));
        assert!(out.last_piece(0, piece("bc")));
        out.end(Event::Failed(kvgate_protocol::openai::ApiError::internal(
            "x",
        )));
        let mut got = Vec::new();
        while let Ok(e) = rx.try_recv() {
            got.push(e);
        }
        assert_eq!(got.len(), 3);
        assert!(matches!(got[2], Event::Failed(_)));
    }

    #[test]
    fn reading_again_stops_the_clock_and_a_stall_tells_the_http_side() {
        let (tx, mut rx) = mpsc::channel(3);
        let (stall_tx, mut stall_rx) = oneshot::channel();
        let mut out = Outbox::new(tx, 1, stall_tx).unwrap();
        let t0 = Instant::now();
        let timeout = Duration::from_millis(10);
        out.piece(piece("a"), t0).unwrap();
        assert!(out.piece(piece("b"), t0).is_err());
        assert!(rx.try_recv().is_ok());
        assert!(!out.is_stalled(t0 + timeout, timeout), "the client read");
        out.piece(piece("c"), t0).unwrap();
        out.full(t0);
        assert!(out.is_stalled(t0 + timeout, timeout));
        out.stall();
        assert_eq!(stall_rx.try_recv(), Ok(()));
        // The receiver gone: pieces are refused as closed.
        let (tx, rx) = mpsc::channel(3);
        let (stall_tx, _) = oneshot::channel();
        let mut out = Outbox::new(tx, 1, stall_tx).unwrap();
        drop(rx);
        assert!(out.is_closed());
        assert!(matches!(out.piece(piece("a"), t0), Err(Refused::Closed)));
        assert!(!out.last_piece(0, piece("a")));
    }
}
