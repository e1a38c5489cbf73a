//! Node mode: processes discovered as they exec or load a library of interest, held at
//! their first load until judged (and attached, or let go).

use lens_common::settings;
use log::{debug, info};

use crate::{
    discovery::{self, NodeFilter},
    error::Result,
    events::{self, ControlEvent, Decoded},
    probes::attach::{self},
    sink::{EventSink, ProcessEnd},
    sys::{
        library::{self, LibraryKind, MappedLibrary},
        target::{self, ProcessInfo},
    },
};

use super::Session;

impl Session {
    /// Node mode: traces every training process on the host that passes `filter`, those
    /// running now (from their next step on) and those that start later (from the moment
    /// they load a training library). Returns how many were running.
    pub fn watch_node(&mut self, filter: NodeFilter) -> Result<usize> {
        self.bpf.maps.settings.set(settings::NODE_MODE, 1)?;
        self.selection.node = Some(filter);
        if let Some(loader) = attach::own_dynamic_loader()? {
            self.probes
                .attacher
                .attach_loader(&mut self.bpf.programs, &loader, &self.groups);
        }
        let mut found = 0;
        for pid in crate::sys::process::all_pids() {
            if pid == std::process::id() {
                continue;
            }
            let Ok(libraries) = self.libraries_of(pid) else {
                continue;
            };
            // Loaders of running processes (containers bring their own): their future
            // children's library loads are seen too.
            self.attach_new_loaders(&libraries);
            if !discovery::maps_training_library(&libraries) {
                continue;
            }
            let Ok(info) = ProcessInfo::read(pid) else {
                continue;
            };
            if self
                .selection
                .node
                .as_ref()
                .is_some_and(|f| f.matches(&info))
                && self.exports(&info)
            {
                self.add_running_target(info, &libraries)?;
                found += 1;
            }
        }
        Ok(found)
    }

    /// Node mode: any process ran a new program; probe its dynamic loader if it is one we
    /// have not seen (a container's own `ld.so`), so its library loads are reported.
    pub(super) fn on_node_exec(&mut self, pid: u32) {
        if let Ok(libraries) = library::find_libraries(pid) {
            self.attach_new_loaders(&libraries);
        }
    }

    pub(super) fn attach_new_loaders(&mut self, libraries: &[MappedLibrary]) {
        for library in libraries {
            if library.kind == LibraryKind::DynamicLoader
                && !self.probes.attacher.is_loader_attached(library)
            {
                info!(
                    "new dynamic loader {}: attaching",
                    library.shown_path.display()
                );
                self.probes
                    .attacher
                    .attach_loader(&mut self.bpf.programs, library, &self.groups);
            }
        }
    }

    /// Node mode: `pid` changed its libraries; trace it if it is a training process that
    /// passes the filter.
    pub(super) fn consider_candidate(&mut self, pid: u32, sink: &mut dyn EventSink) {
        let libraries = match self.libraries_of(pid) {
            Ok(libraries) => libraries,
            Err(error) => {
                debug!("node: pid {pid} not considered: {error}");
                return;
            }
        };
        if !discovery::maps_training_library(&libraries) {
            debug!("node: pid {pid} maps no training library yet");
            return;
        }
        let mut info = match ProcessInfo::read(pid) {
            Ok(info) => info,
            Err(error) => {
                debug!("node: pid {pid} not considered: {error}");
                return;
            }
        };
        if !self
            .selection
            .node
            .as_ref()
            .is_some_and(|f| f.matches(&info))
        {
            debug!("node: pid {pid} ({}) does not match the filter", info.name);
            return;
        }
        if !self.exports(&info) {
            return;
        }
        // Seen as it loads its first training library: its job starts here, before any of
        // its events can arrive (they flow as soon as it is in the kernel's map).
        info.traced_from_start = true;
        sink.on_process_start(&info);
        // Paused while its probes go in (milliseconds), so that its first steps are seen
        // (already, when its load came in a batch with others: `hold_candidates`).
        let stopped = self.stops.held_candidates.remove(&pid) || target::stop(pid);
        let registered = self.add_running_target(info.clone(), &libraries);
        if stopped {
            target::resume(pid);
        }
        if let Err(error) = registered {
            // Most often: it exited in the meantime.
            info!("pid {pid}: {error}");
            sink.on_process_end(&ProcessEnd {
                pid,
                ..ProcessEnd::default()
            });
            return;
        }
        info!("node: tracing pid {pid} ({})", info.name);
    }

    /// Node mode: every new training process (matching the filter) whose library load is
    /// in `batch` is paused before any of them is attached. Attaching one takes long
    /// enough (hundreds of ms for libtorch's probes the first time) for another started
    /// beside it, a job's second rank, to run its start unseen, or its whole life (a
    /// short job: seen, one SLURM task of two missing). `consider_candidate` resumes each.
    pub(super) fn hold_candidates(
        &mut self,
        batch: &[std::result::Result<Decoded, events::DecodeError>],
    ) {
        let Some(filter) = self.selection.node.as_ref() else {
            return;
        };
        let mut hold = Vec::new();
        for event in batch.iter().flatten() {
            let Decoded::Control(ControlEvent::LinkMapChanged {
                tgid,
                traced: false,
                ..
            }) = event
            else {
                continue;
            };
            if self.targets.contains(*tgid) || hold.contains(tgid) {
                continue;
            }
            let trains = self
                .libraries_of(*tgid)
                .is_ok_and(|libraries| discovery::maps_training_library(&libraries));
            if trains && ProcessInfo::read(*tgid).is_ok_and(|info| filter.matches(&info)) {
                hold.push(*tgid);
            }
        }
        for pid in hold {
            if target::stop(pid) {
                self.stops.held_candidates.insert(pid);
            }
        }
    }
}
