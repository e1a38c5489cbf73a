//! lens-probe's own CPU time, all its threads together: what tracing cost the node beside
//! the probe hits on the traced threads (the exit summary's last lines).
use std::time::Duration;

use serde::Serialize;

/// CPU time used by this process (every thread) over a wall-clock span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct OwnCpu {
    pub user_s: f64,
    pub system_s: f64,
    /// From lens-probe's start to the reading.
    pub wall_s: f64,
}

impl OwnCpu {
    /// This process's CPU time so far (`getrusage(RUSAGE_SELF)`), over `wall`.
    pub fn now(wall: Duration) -> OwnCpu {
        // SAFETY: `rusage` is plain data, filled by the call.
        let usage = unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
                return OwnCpu {
                    wall_s: wall.as_secs_f64(),
                    ..OwnCpu::default()
                };
            }
            usage
        };
        let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        OwnCpu {
            user_s: seconds(usage.ru_utime),
            system_s: seconds(usage.ru_stime),
            wall_s: wall.as_secs_f64(),
        }
    }

    pub fn total_s(&self) -> f64 {
        self.user_s + self.system_s
    }

    /// CPU over wall time: 1.0 is one CPU kept busy the whole run.
    pub fn cpus(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.total_s() / self.wall_s
        } else {
            0.0
        }
    }

    /// The exit summary's line.
    pub fn render(&self) -> String {
        format!(
            "lens-probe: its own CPU {:.2} s ({:.2} s user, {:.2} s system) over {:.2} s: \
             {:.0} % of one CPU\n",
            self.total_s(),
            self.user_s,
            self.system_s,
            self.wall_s,
            self.cpus() * 100.0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_used_so_far_is_read_and_said_as_a_share_of_one_cpu() {
        // Burn a little CPU so that the reading cannot be zero.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let cpu = OwnCpu::now(start.elapsed());
        assert!(cpu.total_s() > 0.0, "{cpu:?}");
        assert!(cpu.wall_s >= 0.03, "{cpu:?}");

        let fixed = OwnCpu {
            user_s: 1.5,
            system_s: 0.5,
            wall_s: 4.0,
        };
        assert_eq!(fixed.cpus(), 0.5);
        assert_eq!(
            fixed.render(),
            "lens-probe: its own CPU 2.00 s (1.50 s user, 0.50 s system) over 4.00 s: 50 % of \
             one CPU\n"
        );
        assert_eq!(OwnCpu::default().cpus(), 0.0);
    }
}
