//! Decoding: raw [`Event`] records from the ring buffer into typed [`ProbeEvent`]s, the
//! stream every consumer (summary, span builder, exporters) reads.
use lens_common::{Event, EventKind, NONE_I32, ProbeId};
use serde::Serialize;

use crate::nccl::{DataType, RedOp};

/// A collective or point-to-point operation, named as users know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    Send,
    Recv,
}

impl CollectiveOp {
    fn from_probe(probe: ProbeId) -> Option<CollectiveOp> {
        Some(match probe {
            ProbeId::NcclAllReduce => CollectiveOp::AllReduce,
            ProbeId::NcclBroadcast => CollectiveOp::Broadcast,
            ProbeId::NcclReduce => CollectiveOp::Reduce,
            ProbeId::NcclAllGather => CollectiveOp::AllGather,
            ProbeId::NcclReduceScatter => CollectiveOp::ReduceScatter,
            ProbeId::NcclSend => CollectiveOp::Send,
            ProbeId::NcclRecv => CollectiveOp::Recv,
            _ => return None,
        })
    }

    /// The span name of the call, e.g. `nccl.all_reduce`.
    pub const fn span_name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "nccl.all_reduce",
            CollectiveOp::Broadcast => "nccl.broadcast",
            CollectiveOp::Reduce => "nccl.reduce",
            CollectiveOp::AllGather => "nccl.all_gather",
            CollectiveOp::ReduceScatter => "nccl.reduce_scatter",
            CollectiveOp::Send => "nccl.send",
            CollectiveOp::Recv => "nccl.recv",
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Reduce => "reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::Send => "send",
            CollectiveOp::Recv => "recv",
        }
    }
}

/// What a CUDA synchronisation call waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncKind {
    Stream,
    Event,
    Device,
}

impl SyncKind {
    fn from_probe(probe: ProbeId) -> Option<SyncKind> {
        Some(match probe {
            ProbeId::CudaStreamSynchronize => SyncKind::Stream,
            ProbeId::CudaEventSynchronize => SyncKind::Event,
            ProbeId::CudaDeviceSynchronize => SyncKind::Device,
            _ => return None,
        })
    }

    pub const fn span_name(self) -> &'static str {
        match self {
            SyncKind::Stream => "cuda.stream_synchronize",
            SyncKind::Event => "cuda.event_synchronize",
            SyncKind::Device => "cuda.device_synchronize",
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            SyncKind::Stream => "stream",
            SyncKind::Event => "event",
            SyncKind::Device => "device",
        }
    }
}

/// Where and when: common to every event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CallTiming {
    pub tgid: u32,
    pub tid: u32,
    /// CLOCK_MONOTONIC ns at entry and at return.
    pub start_ns: u64,
    pub end_ns: u64,
}

impl CallTiming {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ProbeEvent {
    Collective {
        #[serde(flatten)]
        timing: CallTiming,
        op: CollectiveOp,
        count: u64,
        /// `None` for a datatype value NCCL does not define (then bytes are unknown).
        datatype: Option<DataType>,
        raw_datatype: i32,
        redop: Option<RedOp>,
        /// Root of Broadcast/Reduce, peer of Send/Recv.
        peer: Option<i32>,
        comm: u64,
        stream: u64,
        result: i32,
    },
    SyncWait {
        #[serde(flatten)]
        timing: CallTiming,
        kind: SyncKind,
        /// The stream or event waited on (0 for device-wide).
        handle: u64,
        result: i32,
    },
    CommInit {
        #[serde(flatten)]
        timing: CallTiming,
        comm: u64,
        rank: i32,
        nranks: i32,
        comm_id_hash: u64,
        result: i32,
    },
    Group {
        #[serde(flatten)]
        timing: CallTiming,
        open: bool,
    },
    LinkMapChanged {
        tgid: u32,
    },
}

impl ProbeEvent {
    pub fn tgid(&self) -> u32 {
        match self {
            ProbeEvent::Collective { timing, .. }
            | ProbeEvent::SyncWait { timing, .. }
            | ProbeEvent::CommInit { timing, .. }
            | ProbeEvent::Group { timing, .. } => timing.tgid,
            ProbeEvent::LinkMapChanged { tgid } => *tgid,
        }
    }

    /// Bytes a collective moves from this rank's point of view: `count × sizeof(dtype)`
    /// with the count the call was given (the send count for AllGather, the receive count
    /// for ReduceScatter, as NCCL's API takes them).
    pub fn bytes(&self) -> Option<u64> {
        match self {
            ProbeEvent::Collective {
                count,
                datatype: Some(datatype),
                ..
            } => Some(count.saturating_mul(datatype.size_bytes())),
            _ => None,
        }
    }
}

/// Why a ring buffer record could not be decoded (counted, never silently dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    TooShort(usize),
    UnknownKind(u32),
    UnknownProbe(u32),
}

fn opt_i32(value: i32) -> Option<i32> {
    (value != NONE_I32).then_some(value)
}

/// Decodes one ring buffer record.
pub fn decode(bytes: &[u8]) -> Result<ProbeEvent, DecodeError> {
    if bytes.len() < size_of::<Event>() {
        return Err(DecodeError::TooShort(bytes.len()));
    }
    // SAFETY: length checked; Event is plain integers, valid for any bit pattern;
    // read_unaligned because the ring buffer only guarantees 8-byte alignment.
    let raw: Event = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    decode_event(&raw)
}

pub fn decode_event(raw: &Event) -> Result<ProbeEvent, DecodeError> {
    let kind = EventKind::from_u32(raw.kind).ok_or(DecodeError::UnknownKind(raw.kind))?;
    let probe = ProbeId::from_u32(raw.probe).ok_or(DecodeError::UnknownProbe(raw.probe))?;
    let timing = CallTiming {
        tgid: raw.tgid,
        tid: raw.tid,
        start_ns: raw.start_ns,
        end_ns: raw.end_ns,
    };
    let result = raw.ret as i32;
    Ok(match kind {
        EventKind::Collective => ProbeEvent::Collective {
            timing,
            op: CollectiveOp::from_probe(probe).ok_or(DecodeError::UnknownProbe(raw.probe))?,
            count: raw.count,
            datatype: DataType::from_raw(raw.datatype),
            raw_datatype: raw.datatype,
            redop: RedOp::from_raw(raw.redop),
            peer: opt_i32(raw.peer),
            comm: raw.comm,
            stream: raw.handle,
            result,
        },
        EventKind::SyncWait => ProbeEvent::SyncWait {
            timing,
            kind: SyncKind::from_probe(probe).ok_or(DecodeError::UnknownProbe(raw.probe))?,
            handle: raw.handle,
            result,
        },
        EventKind::CommInit => ProbeEvent::CommInit {
            timing,
            comm: raw.comm,
            rank: raw.rank,
            nranks: raw.nranks,
            comm_id_hash: raw.comm_id_hash,
            result,
        },
        EventKind::Group => ProbeEvent::Group {
            timing,
            open: raw.group_open != 0,
        },
        EventKind::LinkMapChanged => ProbeEvent::LinkMapChanged { tgid: raw.tgid },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw_allreduce() -> Event {
        let mut raw = Event::zeroed();
        raw.kind = EventKind::Collective as u32;
        raw.probe = ProbeId::NcclAllReduce as u32;
        raw.tgid = 10;
        raw.tid = 11;
        raw.start_ns = 1_000;
        raw.end_ns = 3_500;
        raw.count = 1024;
        raw.datatype = 7;
        raw.redop = 0;
        raw.comm = 0xC0FFEE00;
        raw.handle = 0x5000;
        raw
    }

    fn as_bytes(raw: &Event) -> &[u8] {
        // SAFETY: Event is plain data without padding.
        unsafe { std::slice::from_raw_parts((raw as *const Event).cast(), size_of::<Event>()) }
    }

    #[test]
    fn allreduce_decodes_with_bytes_and_duration() {
        let event = decode(as_bytes(&raw_allreduce())).unwrap();
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
    fn malformed_records_are_reported_not_guessed() {
        assert_eq!(decode(&[0u8; 8]), Err(DecodeError::TooShort(8)));
        let mut raw = raw_allreduce();
        raw.kind = 99;
        assert_eq!(decode_event(&raw), Err(DecodeError::UnknownKind(99)));
        let mut raw = raw_allreduce();
        raw.probe = ProbeId::CudaLaunchKernel as u32;
        assert_eq!(decode_event(&raw), Err(DecodeError::UnknownProbe(0)));
    }

    #[test]
    fn unknown_datatype_keeps_the_raw_value_and_no_bytes() {
        let mut raw = raw_allreduce();
        raw.datatype = 42;
        let event = decode_event(&raw).unwrap();
        assert_eq!(event.bytes(), None);
        assert!(matches!(
            event,
            ProbeEvent::Collective {
                raw_datatype: 42,
                ..
            }
        ));
    }
}
