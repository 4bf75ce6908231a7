//! Stop signals. The first SIGINT or SIGTERM starts a graceful shutdown (no new connections,
//! requests in flight get the grace period); a second one ends the process at once, with the
//! exit status a shell gives a process killed by that signal (130 for SIGINT, 143 for SIGTERM).
//!
//! [`follow_stop_signals`] decides this over any channel of signals, so tests feed it their own;
//! [`shutdown_signal`] wires it to the process's signals.

use std::future::Future;
use std::io;

use tokio::sync::{mpsc, oneshot};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    Interrupt,
    Terminate,
}

impl StopSignal {
    /// 128 + the signal's number, as a shell reports a process that the signal ended.
    pub fn exit_code(self) -> i32 {
        match self {
            StopSignal::Interrupt => 130,
            StopSignal::Terminate => 143,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Interrupt => "SIGINT",
            StopSignal::Terminate => "SIGTERM",
        }
    }
}

/// Follows a process's stop signals: hands the first to `first` (the server then shuts down
/// gracefully) and returns the second, after which the process must exit at once with its
/// [`StopSignal::exit_code`]. `None` when the signals end before a second one.
pub async fn follow_stop_signals(
    mut signals: mpsc::Receiver<StopSignal>,
    first: oneshot::Sender<StopSignal>,
) -> Option<StopSignal> {
    let signal = signals.recv().await?;
    tracing::info!(signal = signal.name(), "stop signal received; a second one exits at once");
    let _ = first.send(signal);
    let second = signals.recv().await?;
    tracing::warn!(
        signal = second.name(),
        exit_code = second.exit_code(),
        "second stop signal: exiting now, requests in flight are dropped"
    );
    Some(second)
}

/// The process's SIGINT and SIGTERM, in the order they arrive. The handlers are installed when
/// this is called (inside a Tokio runtime), so a signal that arrives later is not lost and does
/// not kill the process.
#[cfg(unix)]
pub fn os_stop_signals() -> io::Result<mpsc::Receiver<StopSignal>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let signal = tokio::select! {
                Some(()) = interrupt.recv() => StopSignal::Interrupt,
                Some(()) = terminate.recv() => StopSignal::Terminate,
                else => return,
            };
            if tx.send(signal).await.is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Ctrl-C, reported as SIGINT.
#[cfg(not(unix))]
pub fn os_stop_signals() -> io::Result<mpsc::Receiver<StopSignal>> {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            if tx.send(StopSignal::Interrupt).await.is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// A future that resolves on the first SIGINT or SIGTERM; the second ends the process at once
/// (see the module doc). Call it inside a Tokio runtime.
pub fn shutdown_signal() -> io::Result<impl Future<Output = ()> + Send + 'static> {
    let signals = os_stop_signals()?;
    let (first_tx, first_rx) = oneshot::channel();
    tokio::spawn(async move {
        if let Some(second) = follow_stop_signals(signals, first_tx).await {
            std::process::exit(second.exit_code());
        }
    });
    Ok(async move {
        if first_rx.await.is_err() {
            // The signals are gone: nothing will ask for a shutdown any more.
            std::future::pending::<()>().await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_signal_drains_and_the_second_exits() {
        let (tx, rx) = mpsc::channel(4);
        let (first_tx, mut first_rx) = oneshot::channel();
        let follow = tokio::spawn(follow_stop_signals(rx, first_tx));
        tx.send(StopSignal::Interrupt).await.expect("send");
        assert_eq!((&mut first_rx).await, Ok(StopSignal::Interrupt));
        tokio::task::yield_now().await;
        assert!(!follow.is_finished(), "one signal must not end the process");
        tx.send(StopSignal::Terminate).await.expect("send");
        let second = follow.await.expect("join").expect("a second signal");
        assert_eq!(second, StopSignal::Terminate);
        assert_eq!(second.exit_code(), 143);
        assert_eq!(StopSignal::Interrupt.exit_code(), 130);
    }

    #[tokio::test]
    async fn signals_that_end_after_one_do_not_exit() {
        let (tx, rx) = mpsc::channel(4);
        let (first_tx, first_rx) = oneshot::channel();
        tx.send(StopSignal::Terminate).await.expect("send");
        drop(tx);
        assert_eq!(follow_stop_signals(rx, first_tx).await, None);
        assert_eq!(first_rx.await, Ok(StopSignal::Terminate));
    }
}
