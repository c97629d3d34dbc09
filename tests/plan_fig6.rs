//! The paper's Figure 6: 2 nodes × 2 GPUs, forwarding peers 0↔1 and 2↔3, and the twelve
//! logical flows f1..f12 = C[0,1], C[0,2], C[0,3], C[1,0], …, C[3,2] (row-major, diagonal
//! skipped).
use hoccl::plan::traffic::t_matrix;
use hoccl::plan::{self, png, Cluster, Collective, PlanOptions};

/// f_m gets m MiB, so every cell of T names the flows it carries.
fn figure6() -> (Cluster, Collective) {
    let cl = Cluster::new(2, 2);
    assert_eq!(cl.forwarding_peer, vec![1, 0]);
    let mut sizes = vec![0u64; 16];
    let mut m = 0;
    for u in 0..4 {
        for v in 0..4 {
            if u != v {
                m += 1;
                sizes[u * 4 + v] = m << 20;
            }
        }
    }
    (cl, Collective::AlltoAllv { sizes })
}

fn f(m: u64) -> u64 {
    m << 20
}

#[test]
fn t_matches_the_paper() {
    let (cl, c) = figure6();
    let p = plan::build(&cl, &c, &PlanOptions::default()).unwrap();
    let t = t_matrix(&cl, &p.traffic);
    let cell = |u: usize, v: usize| t[u * 4 + v];
    // "cell 1 ... carries the native f1, the sender-side copies of f2 and f3, and the
    // receiver-side copies of f8 and f11".
    assert_eq!(cell(0, 1), f(1) + f(2) + f(3) + f(8) + f(11));
    assert_eq!(cell(1, 0), f(4) + f(5) + f(6) + f(7) + f(10));
    assert_eq!(cell(2, 3), f(9) + f(7) + f(8) + f(3) + f(6));
    assert_eq!(cell(3, 2), f(12) + f(10) + f(11) + f(2) + f(5));
    // RDMA cells at the staging GPUs: f_m = C[u,v] travels ū → v̄.
    assert_eq!(cell(1, 3), f(2));
    assert_eq!(cell(1, 2), f(3));
    assert_eq!(cell(0, 3), f(5));
    assert_eq!(cell(0, 2), f(6));
    assert_eq!(cell(3, 1), f(7));
    assert_eq!(cell(3, 0), f(8));
    assert_eq!(cell(2, 1), f(10));
    assert_eq!(cell(2, 0), f(11));
    assert!((0..4).all(|x| cell(x, x) == 0), "paired forwarding needs no local copies");
}

#[test]
fn stages_are_contention_free_and_cover_t() {
    let (cl, c) = figure6();
    let p = plan::build(&cl, &c, &PlanOptions::default()).unwrap();
    p.verify().unwrap();
    let mut sum = vec![0u64; 16];
    for s in 0..p.stages.len() {
        let m = p.stage_matrix(s);
        // At most one RDMA entry per row and per column of every stage.
        for x in 0..4 {
            let row = (0..4).filter(|&y| cl.node_of(x) != cl.node_of(y) && m[x * 4 + y] > 0).count();
            let col = (0..4).filter(|&y| cl.node_of(x) != cl.node_of(y) && m[y * 4 + x] > 0).count();
            assert!(row <= 1 && col <= 1, "stage {s}:\n{}", p.show_text(0));
        }
        sum.iter_mut().zip(m).for_each(|(a, b)| *a += b);
    }
    assert_eq!(sum, t_matrix(&cl, &p.traffic));
}

#[test]
fn uniform_figure6_is_two_perfect_stages_at_the_bound() {
    let cl = Cluster::new(2, 2);
    let p = plan::build(&cl, &Collective::AlltoAll { bytes: 1 << 30 }, &PlanOptions::default()).unwrap();
    assert_eq!(p.stages.len(), 2, "{}", p.show_text(4));
    for s in 0..2 {
        assert_eq!(p.stage_nic(s).len(), 4, "stage {s} is a perfect matching of the 4 NICs");
        // The stage's native NVLink work fits in its NIC time: the NIC is the slowest domain.
        assert_eq!(p.stages[s].cost.total(), p.stages[s].cost.nic_s);
    }
    assert!((p.estimate_s() - p.bound().total()).abs() < 1e-12);
    let text = p.show_text(2);
    assert!(text.contains("stage 0") && text.contains("stage 1") && text.contains('*'), "{text}");
    let (w, h, px) = p.stage_image(0, 8);
    assert_eq!((w, h, px.len()), (32, 32, 32 * 32 * 3));
    let file = png::encode_rgb(w, h, &px);
    assert_eq!(&file[1..4], b"PNG");
}
