//! The pure core: `transition` over arbitrary event sequences, driven by the same model of
//! the runtime as the proptest properties (well-timed, late and wrong events alike).
//!
//! Promise: no panic; the same inputs give the same outputs; the stored chain is valid
//! after every step (the current turn's calls may be open), and complete once the
//! conversation is brought to rest: every tool_use has exactly one tool_result.

#![no_main]

use bedrock::state_machine::sim::{Op, World};
use bedrock::state_machine::{transition, validate_chain};
use libfuzzer_sys::fuzz_target;

fn op(kind: u8, arg: u8) -> Op {
    match kind % 20 {
        0 => Op::UserMessage,
        1 => Op::Interrupt {
            stale: arg & 1 == 1,
        },
        2 => Op::TimeLimit,
        3 => Op::Cancel,
        4 => Op::Continue,
        5 => Op::LlmText {
            end_turn: arg & 1 == 1,
            tokens: u16::from(arg) * 5,
        },
        6 => Op::LlmTools {
            names: vec![arg, arg.wrapping_mul(7), arg.wrapping_add(3)][..usize::from(arg % 3) + 1]
                .to_vec(),
        },
        7 => Op::LlmError {
            kind: arg,
            retry_after: (arg & 1 == 1).then_some(u16::from(arg) * 100),
        },
        8 => Op::AbortAck,
        9 => Op::RetryFires,
        10 => Op::ToolDone { ok: arg & 1 == 1 },
        11 => Op::SpawnAck,
        12 => Op::SubAgentDone {
            pick: arg,
            success: arg & 1 == 1,
        },
        13 => Op::Background { wake: arg & 1 == 1 },
        14 => Op::Restart,
        15 => Op::Summarize,
        16 => Op::Wait {
            steer: arg & 1 == 1,
        },
        17 => Op::Dequeue {
            pick: arg,
            all: arg & 1 == 1,
        },
        _ => Op::Stale {
            pick: u16::from(arg),
        },
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&first, rest)) = input.split_first() else {
        return;
    };
    let mut world = World::new(first & 1 == 1);
    for pair in rest.chunks(2).take(200) {
        let op = op(pair[0], pair.get(1).copied().unwrap_or(0));
        let Some(event) = world.event_for(&op) else {
            continue;
        };
        let again = transition(&world.state, &world.ctx, event.clone());
        let outcome = world.apply(event);
        assert_eq!(outcome, again, "the same inputs gave different outputs");
        assert_eq!(validate_chain(&world.log, true), Ok(()), "{:?}", world.log);
    }
    world.settle();
    assert!(
        !world.state.is_busy(),
        "rest is not busy: {:?}",
        world.state
    );
    assert_eq!(validate_chain(&world.log, false), Ok(()), "{:?}", world.log);
});
