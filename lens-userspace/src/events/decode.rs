//! Ring buffer records into events: the header names the kind, the kind names the body
//! (`lens_common::record`), and each body becomes one [`ControlEvent`] or [`ProbeEvent`].
//! A record too short for its kind, of an unknown kind, or from a probe its kind does
//! not come from is refused (and counted by the caller), never guessed at.
use lens_common::record::{
    self as raw, Body, CallTimes, LaunchMark, NONE_I32, Record, RecordHeader, record_bytes,
};
use lens_common::{EventKind, PY_MAX_DEPTH, PY_MAX_WALK, ProbeId, open_flags, rule_index};

use super::{
    CallTiming, CollectiveOp, ControlEvent, DecodeError, Decoded, PhaseSignal, ProbeEvent, PyFrame,
    PythonCaller, SyncKind, TorchScope,
};
use crate::nccl::{DataType, RedOp};

/// Records a reader takes from the ring buffer at a time: decoded together, then handed
/// on (the items borrow the ring, handling them needs the reader's state).
const BATCH: usize = 4096;

/// Takes up to [`BATCH`] records from `ring`, decoded; empty when none is waiting.
pub fn decode_batch(
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
) -> Vec<Result<Decoded, DecodeError>> {
    let mut batch = Vec::new();
    while let Some(item) = ring.next() {
        batch.push(decode(&item));
        if batch.len() == BATCH {
            break;
        }
    }
    batch
}

/// Decodes one ring buffer record.
pub fn decode(bytes: &[u8]) -> Result<Decoded, DecodeError> {
    let header = read::<RecordHeader>(bytes)?;
    let kind = EventKind::from_u32(header.kind).ok_or(DecodeError::UnknownKind(header.kind))?;
    if bytes.len() < record_bytes(kind) {
        return Err(DecodeError::TooShort(bytes.len()));
    }
    let h = &header;
    let probe = || ProbeId::from_u32(h.probe).ok_or(DecodeError::UnknownProbe(h.probe));
    Ok(match kind {
        EventKind::LinkMapChanged => {
            let body = body::<raw::LinkMapChange>(bytes)?;
            Decoded::Control(ControlEvent::LinkMapChanged {
                tgid: h.tgid,
                stopped: body.stopped == 1,
                traced: body.traced == 1,
            })
        }
        EventKind::ProcessForked => Decoded::Control(ControlEvent::ProcessForked {
            parent: body::<raw::Fork>(bytes)?.parent,
            child: h.tgid,
        }),
        EventKind::ProcessExec => Decoded::Control(ControlEvent::ProcessExec {
            tgid: h.tgid,
            traced: body::<raw::Exec>(bytes)?.traced == 1,
        }),
        EventKind::ProcessExit => Decoded::Control(ControlEvent::ProcessExit {
            tgid: h.tgid,
            wait_status: body::<raw::Exit>(bytes)?.wait_status,
        }),
        EventKind::Collective => Decoded::Probe(collective(h, probe()?, body(bytes)?)?),
        EventKind::TimedCall => Decoded::Probe(gloo_call(h, probe()?, body(bytes)?)?),
        EventKind::SyncWait => Decoded::Probe(sync_wait(h, probe()?, body(bytes)?)?),
        EventKind::CommInit => Decoded::Probe(comm_init(h, body(bytes)?)?),
        EventKind::Group => {
            let call = body::<raw::GroupCall>(bytes)?;
            expect_probe(h, &[ProbeId::NcclGroupStart, ProbeId::NcclGroupEnd])?;
            Decoded::Probe(ProbeEvent::Group {
                timing: instant(h, call.at_ns),
                open: call.open != 0,
            })
        }
        EventKind::EventRecorded => {
            let record = body::<raw::EventRecord>(bytes)?;
            expect_probe(
                h,
                &[ProbeId::CudaEventRecord, ProbeId::CudaEventRecordWithFlags],
            )?;
            Decoded::Probe(ProbeEvent::EventRecorded {
                timing: instant(h, record.at_ns),
                event: record.event,
                stream: record.stream,
            })
        }
        EventKind::EventQueried => {
            let query = body::<raw::EventQuery>(bytes)?;
            expect_probe(h, &[ProbeId::CudaEventQuery])?;
            Decoded::Probe(ProbeEvent::EventQueryComplete {
                timing: timing(h, &query.times),
                event: query.event,
                not_ready_ns: (query.not_ready_ns != 0).then_some(query.not_ready_ns),
            })
        }
        EventKind::PhaseEntry => {
            let entry = body::<raw::PhaseEntry>(bytes)?;
            let signal =
                entry_signal(probe()?, entry.argument).ok_or(DecodeError::UnknownProbe(h.probe))?;
            Decoded::Probe(phase(h, &entry.mark, signal))
        }
        EventKind::PhaseReturn => {
            let exit = body::<raw::PhaseReturn>(bytes)?;
            let signal = return_signal(probe()?).ok_or(DecodeError::UnknownProbe(h.probe))?;
            Decoded::Probe(phase(h, &exit.mark, signal))
        }
        EventKind::ScopeEnter => {
            let scope = body::<raw::ScopeEnter>(bytes)?;
            expect_probe(h, &[ProbeId::TorchScopeEnter])?;
            let name = text(&scope.name, scope.name_len);
            let signal = PhaseSignal::ScopeEnter {
                scope: TorchScope::from_name(&name),
                name,
            };
            Decoded::Probe(phase(h, &scope.mark, signal))
        }
        EventKind::RuleEntry => {
            let entry = body::<raw::RuleEntry>(bytes)?;
            let text = (entry.text_len > 0).then(|| text(&entry.text, entry.text_len));
            Decoded::Probe(rule_call(h, &entry.mark, false, entry.args, text, 0)?)
        }
        EventKind::RuleReturn => {
            let exit = body::<raw::RuleReturn>(bytes)?;
            let no_args = [0; lens_common::RULE_ARGS];
            Decoded::Probe(rule_call(h, &exit.mark, true, no_args, None, exit.ret)?)
        }
        EventKind::PyStack => Decoded::Probe(py_stack(h, &body(bytes)?)),
        EventKind::ApiCall => Decoded::Probe(api_call(h, probe()?, body(bytes)?)?),
    })
}

/// A `T` from the first bytes of a record.
fn read<T: Copy>(bytes: &[u8]) -> Result<T, DecodeError> {
    if bytes.len() < size_of::<T>() {
        return Err(DecodeError::TooShort(bytes.len()));
    }
    // SAFETY: long enough; only called with records and headers, plain integers valid for
    // any bit pattern (`Body`'s promise). read_unaligned: the ring buffer only
    // guarantees 8-byte alignment.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
}

/// The body of a record of `B`'s kind.
fn body<B: Body>(bytes: &[u8]) -> Result<B, DecodeError> {
    read::<Record<B>>(bytes).map(|record| record.body)
}

/// The header's probe is one of those its kind comes from.
fn expect_probe(h: &RecordHeader, probes: &[ProbeId]) -> Result<(), DecodeError> {
    if probes.iter().any(|&probe| h.probe == probe as u32) {
        Ok(())
    } else {
        Err(DecodeError::UnknownProbe(h.probe))
    }
}

/// A configured rule's entry or return; the header's probe names the rule.
fn rule_call(
    h: &RecordHeader,
    mark: &LaunchMark,
    at_return: bool,
    args: [u64; lens_common::RULE_ARGS],
    text: Option<String>,
    ret: i64,
) -> Result<ProbeEvent, DecodeError> {
    Ok(ProbeEvent::RuleCall {
        tgid: h.tgid,
        tid: h.tid,
        at_ns: mark.at_ns,
        launches: mark.launches,
        epoch: mark.epoch,
        rule: rule_index(h.probe).ok_or(DecodeError::UnknownProbe(h.probe))?,
        at_return,
        args,
        text,
        ret,
        // A native rule's probe fires at the call itself.
        since_ns: None,
    })
}

fn timing(h: &RecordHeader, times: &CallTimes) -> CallTiming {
    CallTiming {
        tgid: h.tgid,
        tid: h.tid,
        start_ns: times.start_ns,
        end_ns: times.end_ns,
    }
}

/// The timing of an entry-only call: it starts and ends at its entry.
fn instant(h: &RecordHeader, at_ns: u64) -> CallTiming {
    CallTiming {
        tgid: h.tgid,
        tid: h.tid,
        start_ns: at_ns,
        end_ns: at_ns,
    }
}

/// A NUL-terminated string the kernel read, `len` bytes long (clamped to its room).
fn text(bytes: &[u8], len: u32) -> String {
    let len = (len as usize).min(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

/// A gloo collective, seen at its entry (its return only told the enqueue).
fn gloo_call(
    h: &RecordHeader,
    probe: ProbeId,
    call: raw::TimedCall,
) -> Result<ProbeEvent, DecodeError> {
    let op = CollectiveOp::from_gloo_probe(probe).ok_or(DecodeError::UnknownProbe(h.probe))?;
    Ok(ProbeEvent::GlooCall {
        timing: timing(h, &call.times),
        op,
        group: call.object,
        comm: None,
    })
}

fn sync_wait(
    h: &RecordHeader,
    probe: ProbeId,
    call: raw::SyncCall,
) -> Result<ProbeEvent, DecodeError> {
    Ok(ProbeEvent::SyncWait {
        timing: timing(h, &call.times),
        kind: SyncKind::from_probe(probe).ok_or(DecodeError::UnknownProbe(h.probe))?,
        handle: call.handle,
        result: call.result,
        python_caller: PythonCaller::from_code(call.python_caller),
    })
}

/// A call of the generic kind: only from a probe the catalog puts on its programs.
fn api_call(
    h: &RecordHeader,
    probe: ProbeId,
    call: raw::ApiCall,
) -> Result<ProbeEvent, DecodeError> {
    let spec = crate::probes::catalog::spec_of(probe);
    use crate::bpf::Program::{ApiCallReturn, TorchMemoryEntry};
    if spec.exit != Some(ApiCallReturn) && spec.entry != Some(TorchMemoryEntry) {
        return Err(DecodeError::UnknownProbe(h.probe));
    }
    Ok(ProbeEvent::ApiCall {
        timing: timing(h, &call.times),
        probe,
        args: call.args,
        out: call.out,
        result: call.result,
        memory: None,
    })
}

fn comm_init(h: &RecordHeader, call: raw::CommInitCall) -> Result<ProbeEvent, DecodeError> {
    expect_probe(h, &[ProbeId::NcclCommInitRank])?;
    Ok(ProbeEvent::CommInit {
        timing: timing(h, &call.times),
        comm: call.comm,
        rank: call.rank,
        nranks: call.nranks,
        comm_id_hash: call.comm_id_hash,
        result: call.result,
    })
}

fn opt_i32(value: i32) -> Option<i32> {
    (value != NONE_I32).then_some(value)
}

fn collective(
    h: &RecordHeader,
    probe: ProbeId,
    call: raw::CollectiveCall,
) -> Result<ProbeEvent, DecodeError> {
    Ok(ProbeEvent::Collective {
        timing: timing(h, &call.times),
        op: CollectiveOp::from_probe(probe).ok_or(DecodeError::UnknownProbe(h.probe))?,
        count: call.count,
        datatype: DataType::from_raw(call.datatype),
        raw_datatype: call.datatype,
        redop: RedOp::from_raw(call.redop),
        peer: opt_i32(call.peer),
        comm: call.comm,
        stream: call.stream,
        result: call.result,
        python_caller: PythonCaller::from_code(call.python_caller),
    })
}

fn phase(h: &RecordHeader, mark: &LaunchMark, signal: PhaseSignal) -> ProbeEvent {
    ProbeEvent::Phase {
        tgid: h.tgid,
        tid: h.tid,
        at_ns: mark.at_ns,
        launches: mark.launches,
        epoch: mark.epoch,
        signal,
    }
}

/// What a phase-marking function's entry means, from its probe and the argument the
/// entry program kept.
fn entry_signal(probe: ProbeId, argument: u64) -> Option<PhaseSignal> {
    Some(match probe {
        ProbeId::TorchScopeExit => PhaseSignal::ScopeExit,
        // `accumulate_grad`, read from the stack by the entry program.
        ProbeId::TorchBackward if argument & 0xff != 0 => PhaseSignal::BackwardStart,
        ProbeId::TorchBackward => PhaseSignal::GradientStart,
        // `bool` in the low byte of the first argument register.
        ProbeId::TorchGradMode => PhaseSignal::GradMode {
            enabled: argument & 0xff != 0,
        },
        // The `AutogradState` passed by value: grad mode is its first bit.
        ProbeId::TorchInferenceMode => PhaseSignal::GradMode {
            enabled: argument & 1 != 0,
        },
        ProbeId::CheckpointWriterOpen | ProbeId::SafetensorsSerializeFile => {
            PhaseSignal::CheckpointWriteStart
        }
        ProbeId::SafetensorsOpen => PhaseSignal::CheckpointReadStart { own_file: true },
        ProbeId::CheckpointReaderOpen => PhaseSignal::CheckpointReadStart { own_file: false },
        // The open flags, and above them a hash of the path.
        ProbeId::FileOpen | ProbeId::FileOpenAt if argument & open_flags::CREAT != 0 => {
            PhaseSignal::FileCreated {
                path: (argument >> 32) as u32,
            }
        }
        ProbeId::FileOpen | ProbeId::FileOpenAt => PhaseSignal::FileRead {
            path: (argument >> 32) as u32,
        },
        _ => return None,
    })
}

/// What a phase-marking function's return means.
fn return_signal(probe: ProbeId) -> Option<PhaseSignal> {
    Some(match probe {
        ProbeId::TorchBackwardReturn => PhaseSignal::BackwardEnd,
        ProbeId::SafetensorsSerializeFile | ProbeId::CheckpointWriterClose => {
            PhaseSignal::CheckpointWriteEnd
        }
        ProbeId::SafetensorsClose | ProbeId::CheckpointReaderClose => {
            PhaseSignal::CheckpointReadEnd
        }
        _ => return None,
    })
}

fn py_stack(h: &RecordHeader, stack: &raw::PyStack) -> ProbeEvent {
    // The frames kept, innermost first: the last PY_MAX_DEPTH walked, by slot.
    let walked = (stack.depth as usize).min(PY_MAX_WALK);
    let kept = walked.min(PY_MAX_DEPTH);
    ProbeEvent::PyStack {
        tgid: h.tgid,
        tid: h.tid,
        synchronous: stack.synchronous != 0,
        at_ns: stack.mark.at_ns,
        since_ns: (stack.since_ns != 0).then_some(stack.since_ns),
        launches: stack.mark.launches,
        epoch: stack.mark.epoch,
        frames: (walked - kept..walked)
            .map(|i| {
                let slot = i % PY_MAX_DEPTH;
                PyFrame {
                    code: stack.code[slot],
                    frame: stack.frame[slot],
                    first_local: stack.first_local[slot],
                }
            })
            .collect(),
    }
}

/// A record's bytes, as the ring buffer holds them (for tests that build records).
pub fn record_as_bytes<B: Body>(record: &Record<B>) -> &[u8] {
    // SAFETY: a record is plain integers without padding (`Body`'s promise).
    unsafe {
        std::slice::from_raw_parts(
            (record as *const Record<B>).cast::<u8>(),
            size_of::<Record<B>>(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lens_common::record::CollectiveCall;

    fn allreduce() -> Record<CollectiveCall> {
        let mut record = Record::<CollectiveCall>::new(ProbeId::NcclAllReduce as u32, 10, 11);
        record.body.times = CallTimes {
            start_ns: 1_000,
            end_ns: 3_500,
        };
        record.body.count = 1024;
        record.body.datatype = 7;
        record.body.redop = 0;
        record.body.comm = 0xC0FFEE00;
        record.body.stream = 0x5000;
        record
    }

    #[test]
    fn allreduce_decodes_with_bytes_and_duration() {
        let Ok(Decoded::Probe(event)) = decode(record_as_bytes(&allreduce())) else {
            panic!("not a probe event");
        };
        assert_eq!(event.bytes(), Some(4096));
        match event {
            ProbeEvent::Collective {
                timing,
                op,
                redop,
                peer,
                stream,
                ..
            } => {
                assert_eq!(op, CollectiveOp::AllReduce);
                assert_eq!(redop, Some(RedOp::Sum));
                assert_eq!(peer, None);
                assert_eq!(stream, 0x5000);
                assert_eq!(timing.duration_ns(), 2_500);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn process_lifecycle_records_are_control_events() {
        let mut exit = Record::<raw::Exit>::new(raw::NO_PROBE, 10, 10);
        exit.body.wait_status = 9;
        assert_eq!(
            decode(record_as_bytes(&exit)),
            Ok(Decoded::Control(ControlEvent::ProcessExit {
                tgid: 10,
                wait_status: 9
            }))
        );
    }

    #[test]
    fn malformed_records_are_reported_not_guessed() {
        assert_eq!(decode(&[0u8; 8]), Err(DecodeError::TooShort(8)));
        let bytes = record_as_bytes(&allreduce()).to_vec();
        // A header whole, the body cut short.
        assert_eq!(decode(&bytes[..40]), Err(DecodeError::TooShort(40)));
        let mut record = allreduce();
        record.header.kind = 99;
        assert_eq!(
            decode(record_as_bytes(&record)),
            Err(DecodeError::UnknownKind(99))
        );
        let mut record = allreduce();
        record.header.probe = ProbeId::CudaLaunchKernel as u32;
        assert_eq!(
            decode(record_as_bytes(&record)),
            Err(DecodeError::UnknownProbe(0))
        );
    }

    #[test]
    fn unknown_datatype_keeps_the_raw_value_and_no_bytes() {
        let mut record = allreduce();
        record.body.datatype = 42;
        let Ok(Decoded::Probe(event)) = decode(record_as_bytes(&record)) else {
            panic!("not a probe event");
        };
        assert_eq!(event.bytes(), None);
        assert!(matches!(
            event,
            ProbeEvent::Collective {
                raw_datatype: 42,
                ..
            }
        ));
    }

    #[test]
    fn each_kind_is_as_long_as_its_record() {
        for kind in EventKind::ALL {
            let bytes = vec![0u8; record_bytes(kind) - 1];
            let mut bytes = bytes;
            bytes[..4].copy_from_slice(&(kind as u32).to_ne_bytes());
            assert_eq!(
                decode(&bytes),
                Err(DecodeError::TooShort(bytes.len())),
                "{kind:?}"
            );
        }
    }
}
