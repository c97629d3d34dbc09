//! Simulator properties: completion never beats the lower bound, the staged plan reaches
//! the bound on uniform traffic, congestion hurts the naive schedule and not the plan.
use hoccl::plan::rng::Rng;
use hoccl::plan::{self, zipf_sizes, Cluster, Collective, PlanOptions};
use hoccl::sim::baseline::simulate_nccl;
use hoccl::sim::exec::{simulate_naive, simulate_plan};
use hoccl::sim::Model;

fn build(cl: &Cluster, c: &Collective) -> plan::Plan {
    plan::build(cl, c, &PlanOptions::default()).unwrap()
}

#[test]
fn nothing_beats_the_lower_bound() {
    let mut rng = Rng::new(5);
    for seed in 0..40u64 {
        let nodes = rng.range(1, 4) as usize;
        let k = rng.range(1, 4) as usize;
        let cl = Cluster::new(nodes, k);
        let g = cl.num_gpus();
        let c = match seed % 3 {
            0 => Collective::AlltoAll { bytes: rng.range(1 << 20, 1 << 26) },
            1 => Collective::AllGather { bytes: rng.range(1 << 20, 1 << 26) },
            _ => Collective::AlltoAllv { sizes: zipf_sizes(g, 1 << 26, 1.2, seed) },
        };
        let p = build(&cl, &c);
        let lb = p.bound().total();
        for m in [Model::default(), Model::default().fluid()] {
            let staged = simulate_plan(&p, &m).unwrap().completion_s;
            let naive = simulate_naive(&p, &m).unwrap().completion_s;
            assert!(staged >= lb * (1.0 - 1e-9), "seed {seed}: plan {staged} < bound {lb}");
            assert!(naive >= lb * (1.0 - 1e-9), "seed {seed}: naive {naive} < bound {lb}");
        }
    }
}

#[test]
fn uniform_collectives_finish_within_five_percent_of_the_bound() {
    for (nodes, k) in [(2, 2), (4, 8)] {
        let cl = Cluster::new(nodes, k);
        for c in [Collective::AlltoAll { bytes: 1 << 30 }, Collective::AllGather { bytes: 1 << 30 }] {
            let p = build(&cl, &c);
            let r = simulate_plan(&p, &Model::default()).unwrap().completion_s / p.bound().total();
            assert!(r <= 1.05, "{nodes}x{k} {}: {r}", c.name());
        }
    }
}

#[test]
fn incast_hurts_the_naive_schedule_not_the_plan() {
    let cl = Cluster::new(4, 8);
    let p = build(&cl, &Collective::AlltoAll { bytes: 1 << 30 });
    let m = Model::default();
    let staged = simulate_plan(&p, &m).unwrap().completion_s;
    let staged_fluid = simulate_plan(&p, &m.fluid()).unwrap().completion_s;
    let naive = simulate_naive(&p, &m).unwrap().completion_s;
    let naive_fluid = simulate_naive(&p, &m.fluid()).unwrap().completion_s;
    assert!((staged - staged_fluid).abs() <= 1e-9 * staged, "one flow per receiver: no incast");
    assert!(naive > naive_fluid * 1.1, "naive {naive} vs fluid {naive_fluid}");
    assert!(staged < naive, "plan {staged} vs naive {naive}");
}

#[test]
fn skewed_alltoallv_stays_close_to_the_bound() {
    let cl = Cluster::new(4, 8);
    let c = Collective::AlltoAllv { sizes: zipf_sizes(cl.num_gpus(), 1 << 30, 1.2, 7) };
    let p = build(&cl, &c);
    let r = simulate_plan(&p, &Model::default()).unwrap().completion_s / p.bound().total();
    assert!(r <= 1.15, "{r}");
}

#[test]
fn baselines_run_and_respect_their_own_traffic() {
    let cl = Cluster::new(2, 4);
    let m = Model::default().fluid();
    let (name, r) = simulate_nccl(&cl, &Collective::AlltoAll { bytes: 1 << 28 }, &m).unwrap();
    assert_eq!(name, "pairwise");
    // Each GPU sends half its buffer off-node through its own NIC.
    assert!(r.completion_s >= (1u64 << 27) as f64 / cl.nic_bw);
    let (name, r) = simulate_nccl(&cl, &Collective::AllGather { bytes: 1 << 28 }, &m).unwrap();
    assert_eq!(name, "ring");
    assert!(r.completion_s > 0.0);
    let (name, _) = simulate_nccl(&cl, &Collective::Broadcast { root: 3, bytes: 1 << 20 }, &m).unwrap();
    assert_eq!(name, "ring");
    let (name, _) = simulate_nccl(&cl, &Collective::SendRecv { pairs: vec![(0, 5, 1 << 20)] }, &m).unwrap();
    assert_eq!(name, "direct");
}

#[test]
fn model_validation_rejects_nonsense() {
    let m = Model { incast: hoccl::sim::Incast { loss: 1.5 }, ..Model::default() };
    let p = build(&Cluster::new(2, 2), &Collective::AlltoAll { bytes: 1 << 20 });
    assert!(simulate_plan(&p, &m).is_err());
    let m = Model { segments: 0, ..Model::default() };
    assert!(simulate_naive(&p, &m).is_err());
}

#[test]
fn split_routes_simulate_above_the_bound_and_below_fixed_nics() {
    // The planner's dominant-flow case (plan_props): Zipf-3 on 2 nodes x 4 GPUs, routes free
    // to split over each node's NICs. Every part is simulated as its own route; the plan
    // cannot beat its bound and finishes well before the plan whose routes keep their NICs.
    let fixed = Cluster::new(2, 4).with_identity_forwarding();
    let mut cl = fixed.clone();
    cl.balance_nics = true;
    let c = Collective::AlltoAllv { sizes: zipf_sizes(cl.num_gpus(), 16 << 20, 3.0, 7) };
    let opt = PlanOptions { chunk_bytes: 1 << 20 };
    let p = plan::build(&cl, &c, &opt).unwrap();
    assert!(p.traffic.split_flows() > 0);
    let m = Model::default();
    let split = simulate_plan(&p, &m).unwrap().completion_s;
    assert!(split >= p.bound().total() * (1.0 - 1e-9), "plan {split} below its bound {}", p.bound().total());
    assert!(simulate_naive(&p, &m).unwrap().completion_s >= p.bound().total() * (1.0 - 1e-9));
    let whole = simulate_plan(&plan::build(&fixed, &c, &opt).unwrap(), &m).unwrap().completion_s;
    assert!(split < 0.8 * whole, "split {split} s, fixed NICs {whole} s");
}
