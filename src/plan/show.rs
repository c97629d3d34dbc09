//! Human-readable views of a plan: the matrices C, T and T^s as text, and stage matrices
//! drawn as RGB images (blue: NIC cells, orange: NVLink cells, grey: local staging copies).
use super::traffic::{t_matrix, Loads};
use super::Plan;
use std::fmt::Write;

/// Bytes in a short human unit (`1.5G`, `256M`, `12K`, `0`).
pub fn human(b: u64) -> String {
    const U: [(u64, &str); 4] = [(1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    for (s, n) in U {
        if b >= s {
            let v = b as f64 / s as f64;
            return if v >= 100.0 || v.fract() == 0.0 { format!("{v:.0}{n}") } else { format!("{v:.1}{n}") };
        }
    }
    b.to_string()
}

/// A G×G byte matrix as text; NIC cells (different nodes) are marked with `*`, node
/// boundaries with `|`.
pub fn matrix_text(m: &[u64], g: usize, gpus_per_node: usize) -> String {
    let mut s = String::new();
    let w = 7;
    write!(s, "{:>5}", "").unwrap();
    for v in 0..g {
        if v > 0 && v % gpus_per_node == 0 {
            s.push('|');
        }
        write!(s, "{:>w$}", format!("g{v}")).unwrap();
    }
    s.push('\n');
    for u in 0..g {
        write!(s, "{:>5}", format!("g{u}")).unwrap();
        for v in 0..g {
            if v > 0 && v % gpus_per_node == 0 {
                s.push('|');
            }
            let b = m[u * g + v];
            let mark = if b > 0 && u / gpus_per_node != v / gpus_per_node { "*" } else { "" };
            let cell = if b == 0 { ".".to_string() } else { format!("{}{mark}", human(b)) };
            write!(s, "{cell:>w$}").unwrap();
        }
        s.push('\n');
    }
    s
}

impl Plan {
    /// C, T and every stage matrix with its cost, as text (for clusters of up to 64 GPUs;
    /// larger plans print the stage summary only).
    pub fn show_text(&self, max_stages: usize) -> String {
        let cl = &self.cluster;
        let g = cl.num_gpus();
        let mut s = String::new();
        let b = self.bound();
        let spread = Loads::of_traffic(cl, &self.traffic).node_spread_nic_s(cl);
        writeln!(
            s,
            "{} on {}x{} GPUs: {} routes ({} flows split over several NIC pairs), {} native flows, {} stages; estimate {:.3} ms, bound {:.3} ms (nic {:.3}, nvlink {:.3}, ce {:.3}; nic spread over each node's NICs {:.3})",
            self.collective,
            cl.nodes,
            cl.gpus_per_node,
            self.traffic.routes.len(),
            self.traffic.split_flows(),
            self.traffic.natives.len(),
            self.stages.len(),
            self.estimate_s() * 1e3,
            b.total() * 1e3,
            b.nic_s * 1e3,
            b.nvlink_s * 1e3,
            b.ce_s * 1e3,
            spread * 1e3
        )
        .unwrap();
        if g <= 64 {
            writeln!(s, "\nT (effective traffic; * = NIC cell at staging GPUs ū→v̄):\n{}", matrix_text(&t_matrix(cl, &self.traffic), g, cl.gpus_per_node)).unwrap();
        }
        for st in 0..self.stages.len().min(max_stages) {
            let c = self.stages[st].cost;
            writeln!(s, "stage {st}: cost {:.3} ms (nic {:.3}, nvlink {:.3}, ce {:.3})", c.total() * 1e3, c.nic_s * 1e3, c.nvlink_s * 1e3, c.ce_s * 1e3).unwrap();
            if g <= 64 {
                writeln!(s, "{}", matrix_text(&self.stage_matrix(st), g, cl.gpus_per_node)).unwrap();
            }
        }
        if self.stages.len() > max_stages {
            writeln!(s, "… {} more stages", self.stages.len() - max_stages).unwrap();
        }
        s
    }

    /// Stage `s` drawn as an image: one `cell`×`cell` square per matrix cell, colour by
    /// domain, brightness by bytes relative to the stage's largest cell; node boundaries
    /// drawn in light grey. Returns (width, height, RGB bytes).
    pub fn stage_image(&self, s: usize, cell: usize) -> (u32, u32, Vec<u8>) {
        let cl = &self.cluster;
        let g = cl.num_gpus();
        let m = self.stage_matrix(s);
        let max = m.iter().copied().max().unwrap_or(0).max(1) as f64;
        let side = g * cell;
        let mut px = vec![255u8; side * side * 3];
        for u in 0..g {
            for v in 0..g {
                let b = m[u * g + v];
                let colour: [u8; 3] = if b == 0 {
                    [255, 255, 255]
                } else {
                    let f = 0.25 + 0.75 * (b as f64 / max);
                    let mix = |c: f64| (255.0 - (255.0 - c) * f).round() as u8;
                    let base = if u == v {
                        [90.0, 90.0, 90.0]
                    } else if cl.node_of(u) != cl.node_of(v) {
                        [31.0, 90.0, 200.0]
                    } else {
                        [240.0, 140.0, 20.0]
                    };
                    [mix(base[0]), mix(base[1]), mix(base[2])]
                };
                for y in u * cell..(u + 1) * cell {
                    for x in v * cell..(v + 1) * cell {
                        let edge = (x % (cl.gpus_per_node * cell) == 0 || y % (cl.gpus_per_node * cell) == 0) && (x > 0 || y > 0);
                        let c = if edge && b == 0 { [200, 200, 200] } else { colour };
                        px[(y * side + x) * 3..(y * side + x) * 3 + 3].copy_from_slice(&c);
                    }
                }
            }
        }
        (side as u32, side as u32, px)
    }
}
