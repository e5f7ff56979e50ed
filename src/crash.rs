//! A future run with its panic caught in the task that runs it. A tool run and an LLM
//! request each answer exactly once, a panic of their work included; catching it here
//! instead of in a task of its own saves a task made, scheduled and joined for every run
//! and every request (issue 41).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;

/// `future`'s output, or what its panic said. (A task of tokio's asserts unwind safety the
/// same way: nothing the future shares outlives it but what it answers.) The future is
/// boxed: a run's and a request's are some kilobytes, and each layer around a future moves
/// it (a task took a box too).
pub async fn caught<F: Future>(future: std::pin::Pin<Box<F>>) -> Result<F::Output, String> {
    AssertUnwindSafe(future)
        .catch_unwind()
        .await
        .map_err(|payload| said(payload.as_ref()))
}

/// A panic's message, where it has one.
fn said(payload: &(dyn Any + Send)) -> String {
    let message = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
    match message {
        Some(message) => format!("panicked: {message}"),
        None => "panicked".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::caught;

    #[tokio::test]
    async fn a_panic_is_an_answer_and_an_output_is_kept() {
        assert_eq!(caught(Box::pin(async { 7 })).await, Ok(7));
        let number = 3;
        let failed = caught(Box::pin(async move {
            if number == 3 {
                panic!("tool {number} broke");
            }
            1
        }))
        .await;
        assert_eq!(failed, Err("panicked: tool 3 broke".to_owned()));
        let literal: Result<(), String> = caught(Box::pin(async { panic!("plain") })).await;
        assert_eq!(literal, Err("panicked: plain".to_owned()));
        let other: Result<(), String> =
            caught(Box::pin(async { std::panic::panic_any(42_u8) })).await;
        assert_eq!(other, Err("panicked".to_owned()));
    }
}
